"""The engine loop in a thread, over a real engine with a fake runner: every message kind it takes
is answered or applied, with the protocol's own structs; AsyncLLMEngine serves the same when
every message crosses the codec both ways, as it does over the process's pipe; and the engine
process's reader turns bytes it cannot read into the loop's death, not a silent wait."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing import Pipe

import pytest

from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from model_worker import AsyncLLMEngine, RequestRejected
from model_worker.engine.engine_handles import EngineThread
from model_worker.engine.engine_loop import EngineLoop
from model_worker.engine.engine_process_main import _read_into
from model_worker.engine.protocol import (AbortRequest, AddRequest, Alive, Call, CallResult, Dead, EngineCodec,
                                          EngineInput, EngineOutput, FailRequest, GetStats, Rejected,
                                          RequestFinished, RequestProgress, ResetPrefixCache, Shutdown, StepOutputs,
                                          StopRequest)
from tests.unit.fakes import ByteTokenizer, reference_tokens

WAIT_S = 10.0  # a bound on a hang, not a speed check


class Outbox:
    """What the loop emitted, in order, and a bounded wait for what a test expects."""

    def __init__(self) -> None:
        self.messages: list = []
        self._changed = threading.Condition()

    def __call__(self, message) -> None:
        with self._changed:
            self.messages.append(message)
            self._changed.notify_all()

    def wait_for(self, found, what: str):
        deadline_s = time.monotonic() + WAIT_S
        with self._changed:
            while True:
                for message in self.messages:
                    if found(message):
                        return message
                left_s = deadline_s - time.monotonic()
                assert left_s > 0, f"no {what} within {WAIT_S} s; emitted: {[type(m).__name__ for m in self.messages]}"
                self._changed.wait(left_s)

    def finished(self, request_id: str) -> RequestFinished:
        step = self.wait_for(lambda m: isinstance(m, StepOutputs) and any(f.request_id == request_id
                                                                         for f in m.finished), f"finish of {request_id}")
        return next(f for f in step.finished if f.request_id == request_id)

    def tokens(self, request_id: str) -> list[int]:
        return [t for m in self.messages if isinstance(m, StepOutputs)
                for out in [*m.progress, *m.finished] if out.request_id == request_id for t in out.token_ids]

    def result(self, call_id: int) -> CallResult:
        return self.wait_for(lambda m: isinstance(m, CallResult) and m.call_id == call_id, f"result of call {call_id}")


def add(request_id: str, prompt: list[int], max_tokens: int) -> AddRequest:
    return AddRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                      Priority.INTERACTIVE, time.monotonic())


@pytest.fixture
def loop(make_engine):
    engine = make_engine()
    engine.runner.step_delay_s = 0.001  # requests stay running long enough to be aborted or stopped
    outbox = Outbox()
    thread = EngineThread(engine, outbox, time.monotonic)
    thread.outbox = outbox
    yield thread
    thread.shutdown(WAIT_S)
    assert not thread.is_alive()


def test_an_idle_loop_says_it_is_alive(loop):
    assert isinstance(loop.outbox.wait_for(lambda m: isinstance(m, Alive), "alive tick"), Alive)


@pytest.mark.parametrize("moves", [True, False])
def test_a_long_step_beats_while_its_model_moves_and_falls_silent_when_stuck(make_engine, moves):
    """Steps of 0.6 s under a 0.05 s heartbeat: one whose runner makes progress says it is alive
    while it runs (a full token budget of prompts on a slow CPU must not look like a hang to the
    replica, deployments/llm_server.py), one stuck in a single call says nothing until it ends."""
    engine = make_engine()
    engine.runner.step_delay_s = 0.6
    engine.runner.progress_every_s = 0.01 if moves else None
    outbox = Outbox()
    loop = EngineLoop(engine, outbox, time.monotonic, heartbeat_s=0.05)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        loop.submit(add("long", [5, 6, 7], max_tokens=2))
        outbox.finished("long")
    finally:
        loop.submit(Shutdown())
        thread.join(WAIT_S)
    assert not thread.is_alive()
    steps = [i for i, m in enumerate(outbox.messages) if isinstance(m, StepOutputs)]
    beats = [m for m in outbox.messages[:steps[-1]] if isinstance(m, Alive)
             and m.began_s > outbox.messages[steps[0]].began_s]
    if moves:  # 1.2 s of steps: a beat in each after its first 0.1 s, every 0.05 s
        assert len(beats) >= 10
    else:
        assert beats == []


def test_add_streams_progress_then_one_finished_output(loop):
    loop.send(add("r", [5, 6, 7], 6))
    finished = loop.outbox.finished("r")
    assert (finished.finish_reason, finished.num_output_tokens, finished.num_prompt_tokens) == ("length", 6, 3)
    assert finished.timings is not None and len(finished.timings.token_times_s) == 6
    assert loop.outbox.tokens("r") == reference_tokens([5, 6, 7], 6)
    progress = [out for m in loop.outbox.messages if isinstance(m, StepOutputs) for out in m.progress]
    assert progress and all(type(out) is RequestProgress and len(out.token_ids) == 1 for out in progress)
    assert [out.num_output_tokens for out in progress] == list(range(1, len(progress) + 1))


def test_a_duplicate_add_is_rejected_with_its_code_and_param(loop):
    loop.send(add("r", [5, 6], 200))
    loop.send(add("r", [5, 6], 2))
    rejected = loop.outbox.wait_for(lambda m: isinstance(m, Rejected), "rejection")
    exc = rejected.error.to_exception()
    assert rejected.request_id == "r" and isinstance(exc, RequestRejected)
    assert (exc.code, exc.param) == ("duplicate_request_id", "request_id")
    loop.send(AbortRequest("r"))


def test_abort_ends_a_running_request_and_frees_its_blocks(loop):
    loop.send(add("r", [5, 6], 900))
    loop.outbox.wait_for(lambda m: isinstance(m, StepOutputs) and m.progress, "first token")
    loop.send(AbortRequest("r"))
    loop.send(Call(1, GetStats()))
    stats = loop.outbox.result(1).value
    assert stats.requests_finished["abort"] == 1 and stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks


def test_stop_finishes_a_running_request_with_its_stop_string(loop):
    loop.send(add("r", [5, 6], 900))
    loop.outbox.wait_for(lambda m: isinstance(m, StepOutputs) and m.progress, "first token")
    loop.send(StopRequest("r", "<END>"))
    finished = loop.outbox.finished("r")
    assert (finished.finish_reason, finished.stop_reason) == ("stop", "<END>")


def test_fail_ends_a_running_request_unreported_and_frees_its_blocks(loop):
    loop.send(add("r", [5, 6], 900))
    loop.outbox.wait_for(lambda m: isinstance(m, StepOutputs) and m.progress, "first token")
    loop.send(FailRequest("r", "detokenizing this request failed"))
    loop.send(Call(1, GetStats()))
    stats = loop.outbox.result(1).value
    assert stats.requests_finished["error"] == 1 and stats.num_running == 0
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks


def test_calls_are_answered_with_their_values_and_their_errors(loop):
    loop.send(Call(1, GetStats(include_block_hashes=True)))
    loop.send(Call(2, ResetPrefixCache()))
    loop.send(Call(3, GetStats(block_hashes_since=4)))  # needs include_block_hashes: LLMEngine raises
    stats = loop.outbox.result(1)
    assert isinstance(stats.value, EngineStats) and stats.value.cached_block_hashes == () and stats.error is None
    assert loop.outbox.result(2).value is True
    failed = loop.outbox.result(3)
    assert failed.value is None and failed.error.type_name == "ValueError"
    assert "include_block_hashes" in str(failed.error.to_exception())


def test_shutdown_ends_the_loop_and_later_messages_are_answered_not_dropped(loop):
    loop.send(Shutdown())
    loop.send(add("late", [5], 2))
    loop.send(Call(9, GetStats()))
    loop._thread.join(WAIT_S)
    assert not loop.is_alive()
    rejected = loop.outbox.wait_for(lambda m: isinstance(m, Rejected), "rejection")
    assert str(rejected.error.to_exception()) == "the engine is not running"
    assert "not running" in str(loop.outbox.result(9).error.to_exception())


def test_a_message_the_loop_does_not_take_kills_it_with_a_dead_message_that_names_it(loop):
    loop.send(("add", "r", [5]))
    dead = loop.outbox.wait_for(lambda m: isinstance(m, Dead), "dead")
    assert "tuple" in dead.message
    assert not [m for m in loop.outbox.messages if isinstance(m, StepOutputs)]


def test_die_stops_the_loop_with_the_reason(loop):
    loop.loop.die("a message the engine process cannot read: ...")
    dead = loop.outbox.wait_for(lambda m: isinstance(m, Dead), "dead")
    assert dead.message.startswith("a message the engine process cannot read")
    loop._thread.join(WAIT_S)
    assert not loop.is_alive()


# ---- AsyncLLMEngine with every message through the codec -----------------------------------------

def through_the_codec(engine: AsyncLLMEngine) -> AsyncLLMEngine:
    """Encode and decode every message both ways, as the engine process's pipe does."""
    inputs, outputs = EngineCodec(EngineInput), EngineCodec(EngineOutput)
    handle = engine._engine_loop
    submit, emit = handle.loop.submit, handle.loop.emit
    handle.send = lambda message: submit(inputs.decode(inputs.encode(message)))
    handle.loop.emit = lambda message: emit(outputs.decode(outputs.encode(message)))
    return engine


def test_streams_stop_strings_and_calls_are_the_same_through_the_codec(make_engine):
    tokenizer = ByteTokenizer()
    llm = make_engine(vocab_size=259, tokenizer=tokenizer)
    llm.runner.step_delay_s = 0.001
    for i, t in enumerate(tokenizer.encode("abc<END>" + "x" * 30)):
        llm.runner.forced[("s", i)] = t
    engine = through_the_codec(AsyncLLMEngine(engine=llm))

    async def main():
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        tokens, last = [], None
        async for out in engine.generate([5, 6, 7], greedy, request_id="g"):
            tokens += out.token_ids
            last = out
        assert tokens == reference_tokens([5, 6, 7], 8, vocab_size=259) and last.finish_reason == "length"
        assert len(last.timings.token_times_s) == 8
        text = ""
        async for out in engine.generate("go", SamplingParams(max_tokens=38, temperature=0, ignore_eos=True,
                                                              stop=["<END>"]), request_id="s"):
            text += out.text
            last = out
        assert text == "abc" and (last.finish_reason, last.stop_reason) == ("stop", "<END>")
        stats = await engine.stats()
        assert isinstance(stats, EngineStats) and stats.num_free_kv_blocks == stats.num_total_kv_blocks
        assert await engine.reset_prefix_cache() is True

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_request_the_pipe_cannot_carry_is_refused_at_the_door_and_leaves_nothing(make_engine):
    engine = through_the_codec(AsyncLLMEngine(engine=make_engine()))

    async def main():
        huge = SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[2**64])
        with pytest.raises(RequestRejected, match="cannot be sent"):
            engine.add_request([5, 6], huge, request_id="r")
        tokens = []
        async for out in engine.generate([5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                         request_id="r"):
            tokens += out.token_ids
        assert tokens == reference_tokens([5, 6], 3), "the id is free again and the engine still serves"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


# ---- the engine process's reader ------------------------------------------------------------------

class RecordingLoop:
    def __init__(self) -> None:
        self.submitted: list = []
        self.died: list[str] = []

    def submit(self, message) -> None:
        self.submitted.append(message)

    def die(self, reason: str) -> None:
        self.died.append(reason)


def test_the_process_reader_decodes_messages_and_dies_on_bytes_it_cannot_read():
    ours, theirs = Pipe()
    codec = EngineCodec(EngineInput)
    ours.send_bytes(codec.encode(AbortRequest("r")))
    ours.send_bytes(b"\x93\xa6launch\x01\x02")
    loop = RecordingLoop()
    _read_into(theirs, codec, loop)
    assert loop.submitted == [AbortRequest("r")]
    assert len(loop.died) == 1 and "'launch'" in loop.died[0]


def test_the_process_reader_shuts_the_loop_down_when_its_consumer_hangs_up():
    ours, theirs = Pipe()
    ours.close()
    loop = RecordingLoop()
    _read_into(theirs, EngineCodec(EngineInput), loop)
    assert loop.submitted == [Shutdown()] and not loop.died
