"""What the ingress sends to an LLMServer replica and what comes back. Pure Python.

One GenerateRequest carries everything a replica and a request router need: the token ids (the
ingress tokenizes once), the prompt's chained block hashes (computed once, by the ingress, with
the engine's own `hash_prompt_blocks` and the request's cache key; the router scores by them and
the replica's cache uses them as sent, after `RequestChecker.check_block_hashes`), sampling
parameters and priority.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields

from contracts.priority import Priority
from contracts.sampling import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Chained hashes of the prompt's full blocks, in order, with cache_key
    # (model_worker.sched.hashing.hash_prompt_blocks(prompt_token_ids, block_size, cache_key)).
    block_hashes: list[int] = field(default_factory=list)
    # Batch is shed first under overload. Parsed once, here: a handle caller may give the label
    # ("interactive", "batch"); every part downstream reads the enum.
    priority: Priority = Priority.INTERACTIVE
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Mixed into every block hash: requests with different keys never share KV blocks.
    cache_key: str | None = None
    # Output tokens an earlier replica already sent to the client (the ingress migrates a request
    # whose replica died or stalled): this replica continues after them, exactly as that one would.
    resumed_token_ids: list[int] = field(default_factory=list)
    # Replicas that already failed this request: the router sends it elsewhere while it can.
    avoid_replica_ids: list[str] = field(default_factory=list)
    # Written by the request router in the caller's process: the replica it chose for the latest
    # attempt, so that a caller whose attempt hung before any reply knows which replica to avoid.
    routed_replica_id: str | None = None
    # Where the replica sends this request's chunks after the admission chunk, when it runs on the
    # caller's node (deployments/token_channel.py); None: every chunk comes back over Ray's stream.
    token_channel: TokenChannelAddress | None = None

    def __post_init__(self) -> None:
        self.priority = Priority.parse(self.priority)


@dataclass(frozen=True, slots=True)
class TokenChannelAddress:
    """A caller's token channel, for one attempt of one request: a loopback listener on the caller's
    Ray node, the secret a connection must open with, and the key that marks this attempt's chunks."""

    host: str
    port: int
    # Ray's node id of the caller: only a replica on the same node can reach a loopback listener.
    node_id: str
    secret: str
    key: str


@dataclass(slots=True)
class RequestTimings:
    """Wall-clock seconds (time.monotonic, on the engine's clock) of a request's milestones; None
    until reached."""

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    # One entry per output token, when it was sampled.
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


# One output token's log probabilities (SamplingParams.logprobs): its own, then the ids and log
# probabilities of the most likely tokens, most likely first. Plain values, so that it crosses
# every wire as it is (a tuple arrives as a list).
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass(slots=True)
class GenerationChunk:
    """One step's progress of a request: what the engine's step returns for each request that made
    progress, and, as it is, what a replica streams (several coalesced by `extend`). The unary call
    returns a single finished chunk."""

    request_id: str
    # Text that became final in this chunk (never half a UTF-8 character, never a stop string).
    text: str = ""
    # Token ids sampled in this chunk (an EOS or stop token id included).
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # "stop" (EOS, stop string or stop token), "length" (max_tokens), "abort" (aborted), "error"
    # (the step failed on this request: `error` says how), or None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, if one did.
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    # Output tokens so far, this chunk's included.
    num_output_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # Set on the finished chunk: the engine-side milestones (TTFT, queue time, E2E, token times).
    timings: RequestTimings | None = None
    # Why the request failed, with finish_reason "error"; None otherwise.
    error: str | None = None
    # The LLMServer replica that served the request (routing tests and debugging).
    replica_id: str | None = None
    # No progress, only proof of life: the replica and its engine loop are working (sent about
    # once a second while a request waits), so a caller can tell a slow request from a dead replica.
    keepalive: bool = False
    # On the admission chunk: the chunks after it come over the request's token channel, not this
    # stream (which then ends once the last of them was sent).
    via_channel: bool = False
    # With SamplingParams.logprobs set: one TokenLogprobs per entry of token_ids; else None.
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs set, on the chunk of the first output token: one entry
    # per prompt token, None for the first; else None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def extend(self, later: "GenerationChunk") -> None:
        """Fold a later chunk of the same request into this one: texts and tokens add up, the rest
        is the later one's. Keep-alives carry nothing and change nothing."""
        if later.keepalive:
            return
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or ()), *later.logprobs]
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.token_ids.extend(later.token_ids)
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        self.timings = later.timings
        self.error = later.error
        self.replica_id = later.replica_id or self.replica_id


def chunk_to_wire(chunk: GenerationChunk) -> list:
    """The chunk as plain JSON values, field by field in declaration order (timings as a list too)."""
    values = [getattr(chunk, f.name) for f in fields(GenerationChunk)]
    timings = chunk.timings
    if timings is not None:
        values[_TIMINGS_FIELD] = [getattr(timings, f.name) for f in fields(RequestTimings)]
    return values


def chunk_from_wire(values: list) -> GenerationChunk:
    """The inverse of chunk_to_wire; ValueError for anything else."""
    if not isinstance(values, list) or len(values) != len(_CHUNK_FIELDS):
        raise ValueError(f"a chunk on the wire is a list of {len(_CHUNK_FIELDS)} values")
    timings = values[_TIMINGS_FIELD]
    try:
        if timings is not None:
            values = [*values]
            values[_TIMINGS_FIELD] = RequestTimings(*timings)
        return GenerationChunk(*values)
    except TypeError as exc:
        raise ValueError(f"not a chunk: {exc}") from None


@dataclass(slots=True)
class ModelInfo:
    """What the ingress needs to know about the model a replica serves."""

    served_model_name: str
    max_model_len: int
    block_size: int
    vocab_size: int | None
    eos_token_ids: list[int]
    # Unix time the replica loaded the model (the OpenAI `created` field).
    created: int


_CHUNK_FIELDS = [f.name for f in fields(GenerationChunk)]
_TIMINGS_FIELD = _CHUNK_FIELDS.index("timings")


async def whole_response(request_id: str, chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    """A unary answer: every chunk of a stream folded into one finished chunk."""
    whole = GenerationChunk(request_id)
    async for chunk in chunks:
        whole.extend(chunk)
    return whole
