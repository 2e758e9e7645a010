"""The engine loop's messages: one typed struct per kind, imported by both ends.

    in:  StartEngine                                          (the process, once, first)
         AddRequest  AbortRequest  StopRequest  FailRequest  Call  Shutdown
    out: Ready | LoadFailed                                   (the process, once, at start)
         StepOutputs (each step)   Alive (each idle tick)
         CallResult  Rejected  Dead

Every message is a msgspec Struct tagged with its MessageKind and `array_like=True`: it crosses as
a msgpack array, the kind first and then the fields in their declared order, as compact as a
tuple, and is decoded into the same type at the other end with its field types checked. A field is
therefore only ever appended, with a default, never reordered, renamed in place or removed: a
reader decodes a message written without the newer trailing fields (they take their defaults),
and ignores trailing fields it does not know. Every field crosses, defaults included: msgspec's
`omit_defaults` does nothing for array-like structs (msgspec issue 720), so it is not set.

A step's outputs are one StepOutputs: a running request's progress is a RequestProgress (id, token
ids, two counts, nothing else), a finished one a RequestFinished. Errors cross as EngineError and
are rebuilt into an exception on the consumer's side: a RequestRejected keeps its code and param.

In a process (model_worker/engine/engine_handles.py EngineProcess) each message is encoded once by
EngineCodec and sent as bytes over the pipe; in a thread the same structs are handed over as they
are. The field types below are those msgspec decodes natively: plain values, these structs, and
the contract dataclasses (SamplingParams, EngineConfig, SchedulerConfig, RequestTimings,
EngineStats), which cross by field name and are validated again on decoding (__post_init__).
Integers are 64-bit on the wire: a message holding a larger one cannot be encoded (ProtocolError).
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import GenerationChunk, RequestTimings
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.sched.request_checks import RequestRejected


class MessageKind(str, enum.Enum):
    """Every message's tag: the first element of its array on the wire."""

    START = "start"
    ADD = "add"
    ABORT = "abort"
    STOP = "stop"
    FAIL = "fail"
    CALL = "call"
    SHUTDOWN = "shutdown"
    READY = "ready"
    LOAD_FAILED = "failed"
    STEP = "step"
    ALIVE = "alive"
    RESULT = "result"
    REJECTED = "rejected"
    DEAD = "dead"


class ProtocolError(ValueError):
    """A message that could not be encoded, or bytes that are not a message of this protocol."""


class _Struct(msgspec.Struct, array_like=True):
    """Positional on the wire: fields are appended, with a default, never reordered."""


class _Message(_Struct):
    @property
    def kind(self) -> MessageKind:
        return MessageKind(type(self).__struct_config__.tag)


# ---- parts of messages --------------------------------------------------------------------------

class EngineInfo(_Struct):
    """What the consumer needs to know of a built engine: fixed once it is built."""

    vocab_size: int | None
    eos_token_ids: frozenset[int]
    limits: SchedulerConfig
    # Seconds each part of loading took (imports, weights, tokenizer, KV cache).
    load_times_s: dict[str, float] = {}


class EngineError(_Struct, frozen=True):
    """An exception that crosses. A RequestRejected keeps its code and param; any other becomes,
    on the consumer's side, a RuntimeError whose message names the original type."""

    # The original exception's class name ("RequestRejected" is rebuilt as one).
    type_name: str
    # What the rebuilt exception says.
    message: str
    # RequestRejected's code and param; None for any other type.
    code: str | None = None
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> "EngineError":
        if isinstance(exc, RequestRejected):
            return cls("RequestRejected", str(exc), exc.code, exc.param)
        return cls(type(exc).__name__, f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        if self.type_name == "RequestRejected":
            return RequestRejected(self.message, self.code or "invalid_request", self.param)
        return RuntimeError(self.message)


# Error of a request or a call that reaches a loop that has stopped.
NOT_RUNNING = EngineError("RuntimeError", "the engine is not running")


class RequestProgress(_Struct, gc=False):
    """One step of a running request: the token it sampled and its counts. gc=False: a step holds
    one per running request, none of them in a reference cycle, so the collector never scans them."""

    request_id: str
    token_ids: list[int]
    # Output tokens so far (resumed ones included), this step's included.
    num_output_tokens: int
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int
    # One entry per token id, when the request asked for logprobs.
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    # On the first output token of a request that asked for its prompt's logprobs.
    prompt_logprobs: list[tuple[float, list[int], list[float]] | None] | None = None

    def to_chunk(self, num_prompt_tokens: int) -> GenerationChunk:
        return GenerationChunk(self.request_id, token_ids=self.token_ids, num_prompt_tokens=num_prompt_tokens,
                               num_output_tokens=self.num_output_tokens, num_cached_tokens=self.num_cached_tokens,
                               logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)


class RequestFinished(_Struct):
    """A request's last output: why it finished, its counts and timings (GenerationChunk's fields
    that the step loop sets; it never makes text)."""

    request_id: str
    # "stop", "length", "abort" or "error" (then `error` says why).
    finish_reason: str
    token_ids: list[int] = []
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    prompt_logprobs: list[tuple[float, list[int], list[float]] | None] | None = None

    @classmethod
    def of(cls, out: GenerationChunk) -> "RequestFinished":
        return cls(out.request_id, out.finish_reason, out.token_ids, out.stop_reason, out.num_prompt_tokens,
                   out.num_output_tokens, out.num_cached_tokens, out.timings, out.error, out.logprobs,
                   out.prompt_logprobs)

    def to_chunk(self) -> GenerationChunk:
        return GenerationChunk(self.request_id, token_ids=self.token_ids, finished=True,
                               finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                               num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens,
                               num_cached_tokens=self.num_cached_tokens, timings=self.timings, error=self.error,
                               logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)


# What a consumer may ask of the engine between two steps. A call is one of these (tagged by its
# method's name); its CallResult's value is what the method returns.

class GetStats(_Struct, tag="stats"):
    """LLMEngine.stats: an EngineStats."""

    include_block_hashes: bool = False
    block_hashes_since: int | None = None


class ResetPrefixCache(_Struct, tag="reset_prefix_cache"):
    """LLMEngine.reset_prefix_cache: a bool."""


EngineCall = Union[GetStats, ResetPrefixCache]
# What a call returns. At most one type in it may encode as a map (msgspec's rule for untagged
# unions): a call that returns another such type needs its result tagged too.
CallValue = Union[EngineStats, bool, None]


# ---- into the loop ------------------------------------------------------------------------------

class StartEngine(_Message, tag=MessageKind.START.value):
    """The engine to build: the process's first message."""

    config: EngineConfig


class AddRequest(_Message, tag=MessageKind.ADD.value):
    """A request whose prompt, resumed tokens and block hashes passed the sender's checks
    (AsyncLLMEngine.add_request): the loop queues it without scanning them again."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority
    # When it came in, on the clock every process of the machine shares (time.monotonic).
    arrival_s: float
    cache_key: str | None = None
    resumed_token_ids: list[int] = []
    block_hashes: list[int] = []


class AbortRequest(_Message, tag=MessageKind.ABORT.value):
    request_id: str


class StopRequest(_Message, tag=MessageKind.STOP.value):
    """Finish a request on a stop string its consumer found in the text."""

    request_id: str
    stop_reason: str


class FailRequest(_Message, tag=MessageKind.FAIL.value):
    """End a request with an error found outside the step (its text could not be made)."""

    request_id: str
    message: str


class Call(_Message, tag=MessageKind.CALL.value):
    """Run `call` between two steps; answered by a CallResult with the same call_id."""

    call_id: int
    call: EngineCall


class Shutdown(_Message, tag=MessageKind.SHUTDOWN.value):
    pass


# ---- out of the loop ----------------------------------------------------------------------------

class Ready(_Message, tag=MessageKind.READY.value):
    info: EngineInfo


class LoadFailed(_Message, tag=MessageKind.LOAD_FAILED.value):
    message: str


class StepOutputs(_Message, tag=MessageKind.STEP.value):
    """One step's outputs. `began_s` is when that loop iteration began, on the loop's clock
    (time.monotonic in the process: the same clock in every process of the machine): the
    consumer's liveness check. A request appears at most once, in one of the two lists."""

    began_s: float
    progress: list[RequestProgress] = []
    finished: list[RequestFinished] = []


class Alive(_Message, tag=MessageKind.ALIVE.value):
    """An idle loop's tick: it is waiting for work, not stuck."""

    began_s: float


class CallResult(_Message, tag=MessageKind.RESULT.value):
    call_id: int
    value: CallValue = None
    # Set when the call raised (value is then None).
    error: EngineError | None = None


class Rejected(_Message, tag=MessageKind.REJECTED.value):
    """An AddRequest the engine refused (a duplicate id, a request that cannot fit, a stopped loop)."""

    request_id: str
    error: EngineError


class Dead(_Message, tag=MessageKind.DEAD.value):
    """The loop stopped on an error and answers nothing more."""

    message: str


LoopInput = Union[AddRequest, AbortRequest, StopRequest, FailRequest, Call, Shutdown]
EngineInput = Union[StartEngine, LoopInput]
EngineOutput = Union[Ready, LoadFailed, StepOutputs, Alive, CallResult, Rejected, Dead]


class EngineCodec:
    """Bytes to and from one direction's messages: encodes any message, decodes those of `decodes`
    (EngineInput in the engine's process, EngineOutput in its consumer's)."""

    def __init__(self, decodes: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decodes)

    def encode(self, message: _Message) -> bytes:
        try:
            return self._encoder.encode(message)
        except (msgspec.EncodeError, OverflowError, TypeError) as exc:
            raise ProtocolError(f"cannot encode a {type(message).__name__} message: {exc}") from exc

    def decode(self, data: bytes) -> _Message:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            head = bytes(data[:32])
            raise ProtocolError(f"not an engine message ({exc}), {len(data)} bytes: {head!r}"
                                f"{'...' if len(data) > 32 else ''}") from exc
