"""The engine loop's messages: the codec carries each kind as itself, refuses what is not a
message (saying what came), rebuilds errors, and reads messages of an older or newer version."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import GenerationChunk, RequestTimings
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine.protocol import (NOT_RUNNING, AbortRequest, AddRequest, Alive, Call, CallResult, Dead,
                                          EngineCodec, EngineError, EngineInfo, EngineInput, EngineOutput,
                                          FailRequest, GetStats, LoadFailed, MessageKind, ProtocolError, Ready,
                                          Rejected, RequestFinished, RequestProgress, ResetPrefixCache, Shutdown,
                                          StartEngine, StepOutputs, StopRequest)
from model_worker.sched.request_checks import RequestRejected

INPUT = EngineCodec(EngineInput)
OUTPUT = EngineCodec(EngineOutput)


def some_stats() -> EngineStats:
    values = {"kv_usage": 0.25, "prefix_cache_hit_rate": 0.5, "tokens_per_s": 12.5, "step_time_s": 1.5,
              "forward_time_s": 1.0, "execute_time_s": 1.25, "ttft_p50_s": 0.1, "ttft_p90_s": None,
              "ttft_p99_s": None, "requests_finished": {"stop": 2, "length": 1, "abort": 0, "error": 0},
              "cached_block_hashes": (1, 2**64 - 1), "block_hashes_since": None}
    fields = {f.name: values.get(f.name, 7) for f in dataclasses.fields(EngineStats)
              if f.name in values or f.default is dataclasses.MISSING}
    return EngineStats(**fields)


INPUTS = [
    StartEngine(EngineConfig(model="tiny", num_kv_blocks=64, kv_cache_memory_gib=2, engine_process=True)),
    AddRequest("r1", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.5, seed=3, stop=["\n"]),
               Priority.BATCH, 1234.5, "salt", [8, 9], [2**64 - 1, 0]),
    AddRequest("r2", [5], SamplingParams(), Priority.INTERACTIVE, 1.0),
    AbortRequest("r1"),
    StopRequest("r1", "<END>"),
    FailRequest("r1", "detokenizing this request failed"),
    Call(7, GetStats(include_block_hashes=True, block_hashes_since=41)),
    Call(8, ResetPrefixCache()),
    Shutdown(),
]
OUTPUTS = [
    Ready(EngineInfo(1000, frozenset({1, 2}), SchedulerConfig(4, 64, 8, 128, 512), {"weights": 0.5})),
    LoadFailed("OSError: no such checkpoint"),
    StepOutputs(10.5, [RequestProgress("a", [17], 3, 8), RequestProgress("b", [18], 1, 0)],
                [RequestFinished("c", "length", [19], None, 4, 2, 0, RequestTimings(9.0, 9.1, 9.2, 9.3, [9.2, 9.3])),
                 RequestFinished("d", "stop", [], "<END>", 4, 2),
                 RequestFinished("e", "error", error="the model failed on this request: ValueError: x")]),
    StepOutputs(11.0),
    Alive(12.0),
    CallResult(7, some_stats()),
    CallResult(8, True),
    CallResult(9, error=EngineError.of(ValueError("bad"))),
    Rejected("r1", EngineError.of(RequestRejected("in use", code="duplicate_request_id", param="request_id"))),
    Rejected("r2", NOT_RUNNING),
    Dead("engine step failed: EngineBroken: the runner keeps failing"),
]


def test_the_examples_cover_every_kind():
    assert {m.kind for m in INPUTS + OUTPUTS} == set(MessageKind)


@pytest.mark.parametrize("message", INPUTS, ids=lambda m: m.kind.value)
def test_every_input_kind_round_trips_to_an_equal_struct(message):
    data = INPUT.encode(message)
    assert msgspec.msgpack.decode(data)[0] == message.kind.value, "the kind is the first element"
    decoded = INPUT.decode(data)
    assert type(decoded) is type(message) and decoded == message


@pytest.mark.parametrize("message", OUTPUTS, ids=lambda m: m.kind.value)
def test_every_output_kind_round_trips_to_an_equal_struct(message):
    decoded = OUTPUT.decode(OUTPUT.encode(message))
    assert type(decoded) is type(message) and decoded == message


def test_decoded_fields_have_their_declared_types():
    add = INPUT.decode(INPUT.encode(INPUTS[1]))
    assert add.priority is Priority.BATCH and isinstance(add.params, SamplingParams)
    assert add.block_hashes == [2**64 - 1, 0]
    ready = OUTPUT.decode(OUTPUT.encode(OUTPUTS[0]))
    assert ready.info.eos_token_ids == frozenset({1, 2}) and isinstance(ready.info.limits, SchedulerConfig)
    stats = OUTPUT.decode(OUTPUT.encode(OUTPUTS[5])).value
    assert isinstance(stats, EngineStats) and stats.cached_block_hashes == (1, 2**64 - 1)


def test_a_progress_output_is_as_compact_as_a_tuple():
    """A running request's step crosses as [id, token ids, two counts, logprobs, prompt logprobs]:
    no names, no kind, and one byte (nil) for each kind of logprobs it did not ask for."""
    data = OUTPUT.encode(StepOutputs(1.0, [RequestProgress("a", [17], 3, 8)]))
    assert msgspec.msgpack.decode(data) == ["step", 1.0, [["a", [17], 3, 8, None, None]], []]
    logprobs = [(-0.25, [17, 4], [-0.25, -2.5])]
    data = OUTPUT.encode(StepOutputs(1.0, [RequestProgress("a", [17], 3, 8, logprobs)]))
    assert OUTPUT.decode(data).progress[0].to_chunk(5).logprobs == [(-0.25, [17, 4], [-0.25, -2.5])]


def test_an_unknown_kind_is_an_error_that_names_it():
    with pytest.raises(ProtocolError, match="'launch'"):
        INPUT.decode(msgspec.msgpack.encode(["launch", "r1"]))


def test_a_message_of_the_other_direction_is_an_error_that_names_its_kind():
    with pytest.raises(ProtocolError, match="'shutdown'"):
        OUTPUT.decode(INPUT.encode(Shutdown()))


@pytest.mark.parametrize("data", [b"", b"\xc1\x00garbage", msgspec.msgpack.encode({"kind": "add"}),
                                  msgspec.msgpack.encode(["add", "r1"])])
def test_malformed_bytes_are_an_error_that_shows_what_came(data):
    with pytest.raises(ProtocolError, match=f"{len(data)} bytes") as info:
        INPUT.decode(data)
    assert repr(data[:8])[2:-1] in str(info.value)


def test_a_field_of_the_wrong_type_is_an_error_that_names_the_field():
    data = msgspec.msgpack.encode(["abort", 17])
    with pytest.raises(ProtocolError, match=r"\$\[1\]"):
        INPUT.decode(data)


def test_sampling_params_are_validated_again_on_decoding():
    data = msgspec.msgpack.encode(["add", "r", [5], {"max_tokens": 0}, 0, 1.0])
    with pytest.raises(ProtocolError, match="max_tokens"):
        INPUT.decode(data)


def test_an_int_beyond_64_bits_cannot_be_encoded():
    add = AddRequest("r", [5], SamplingParams(stop_token_ids=[2**64]), Priority.INTERACTIVE, 1.0)
    with pytest.raises(ProtocolError, match="AddRequest"):
        INPUT.encode(add)


def test_a_request_rejected_crosses_with_its_code_and_param():
    sent = RequestRejected("request id 'r1' is already in use", code="duplicate_request_id", param="request_id")
    crossed = OUTPUT.decode(OUTPUT.encode(Rejected("r1", EngineError.of(sent)))).error.to_exception()
    assert type(crossed) is RequestRejected and isinstance(crossed, ValueError)
    assert (str(crossed), crossed.code, crossed.param) == (str(sent), "duplicate_request_id", "request_id")


def test_any_other_error_crosses_as_a_runtime_error_naming_its_type():
    crossed = OUTPUT.decode(OUTPUT.encode(CallResult(3, error=EngineError.of(KeyError("k"))))).error
    exc = crossed.to_exception()
    assert type(exc) is RuntimeError and str(exc) == "KeyError: 'k'"
    assert NOT_RUNNING.to_exception().args == ("the engine is not running",)


def test_outputs_turn_back_into_the_chunks_the_step_made():
    timings = RequestTimings(1.0, 1.1, 1.2, 1.3, [1.2, 1.3])
    chunk = GenerationChunk("c", token_ids=[5], finished=True, finish_reason="stop", stop_reason=7,
                            num_prompt_tokens=3, num_output_tokens=2, num_cached_tokens=1, timings=timings)
    assert RequestFinished.of(chunk).to_chunk() == chunk
    assert RequestProgress("p", [9], 4, 2).to_chunk(num_prompt_tokens=6) == GenerationChunk(
        "p", token_ids=[9], num_prompt_tokens=6, num_output_tokens=4, num_cached_tokens=2)


# ---- versions -----------------------------------------------------------------------------------

def appended(struct_type: type, name: str = "added_later", default: object = None) -> type:
    """The next version of a struct: its fields in order, then one more with a default."""
    fields: list[tuple] = []
    for f in msgspec.structs.fields(struct_type):
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(f"{struct_type.__name__}Next", fields + [(name, int | None, default)],
                             array_like=True, tag=struct_type.__struct_config__.tag)


@pytest.mark.parametrize("message", INPUTS + OUTPUTS, ids=lambda m: m.kind.value)
def test_a_reader_with_a_field_appended_decodes_messages_written_without_it(message):
    newer = appended(type(message))
    decoded = msgspec.msgpack.Decoder(newer).decode(msgspec.msgpack.encode(message))
    assert decoded.added_later is None
    for field in msgspec.structs.fields(type(message)):
        assert getattr(decoded, field.name) == getattr(message, field.name)


@pytest.mark.parametrize("message", INPUTS + OUTPUTS, ids=lambda m: m.kind.value)
def test_a_reader_without_an_appended_field_decodes_messages_written_with_it(message):
    newer = appended(type(message))
    written = newer(**msgspec.structs.asdict(message), added_later=5)
    codec = INPUT if any(m is message for m in INPUTS) else OUTPUT
    assert codec.decode(msgspec.msgpack.encode(written)) == message


def test_a_progress_output_with_an_appended_field_decodes_inside_a_step():
    """What the next field of a running request's output (a choice index, after the logprobs)
    needs: the step that carries it still reads, at both versions."""
    newer_progress = appended(RequestProgress, "choice_index", 0)
    newer_step = msgspec.defstruct("StepOutputsNext", [("began_s", float), ("progress", list[newer_progress], [])],
                                   array_like=True, tag="step")
    old = StepOutputs(1.0, [RequestProgress("a", [17], 3, 8)])
    assert msgspec.msgpack.Decoder(newer_step).decode(OUTPUT.encode(old)).progress[0].choice_index == 0
    new = newer_step(1.0, [newer_progress("a", [17], 3, 8, None, None, 2)])
    assert OUTPUT.decode(msgspec.msgpack.encode(new)) == old
