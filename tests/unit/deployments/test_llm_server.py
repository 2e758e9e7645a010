"""LLMServer's Serve hooks and configuration, over a real engine with the fake KV runner; its
stream chunk coalescing over a scripted engine whose outputs come at set times on a fake clock."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

import pytest

from contracts.serving import GenerateRequest, GenerationChunk
from deployments.app_config import AppArgs
from deployments.errors import APIError
from autoscaler.admission import replica_policy
from contracts.priority import Priority
from deployments.llm_server import LLMServer, _engine_config
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from tests.unit.fakes import FakeClock, FakeKVRunner, reference_tokens


def make_server(max_model_len: int = 256, **admission) -> LLMServer:
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(64, 4, max_model_len, 300))
    return LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", admission=admission,
                     replica_id="r0")


def test_hooks_report_engine_state_in_the_types_serve_accepts():
    server = make_server()

    async def main():
        held = server.generate_stream(GenerateRequest([5, 6, 7, 8, 9], SamplingParams(max_tokens=3)))
        await held.__anext__()
        autoscaling = await server.record_autoscaling_stats()
        routing = await server.record_routing_stats()
        await held.aclose()
        await server.check_health()
        return autoscaling, routing

    try:
        autoscaling, routing = asyncio.run(main())
    finally:
        server.shutdown()
    # Serve drops a replica's custom autoscaling metrics if one value is not an int or float.
    assert all(type(v) in (int, float) for v in autoscaling.values()), autoscaling
    assert autoscaling["num_waiting_first_token"] == 1 and autoscaling["num_total_kv_blocks"] == 64
    assert autoscaling["num_seats"] == EngineConfig().max_num_seqs
    assert routing["replica_id"] == "r0" and routing["block_size"] == 4 and routing["num_total_kv_blocks"] == 64


def test_routing_stats_send_the_prefix_caches_changes_after_a_first_full_report():
    from contracts import RoutingReport
    from router.prefix_index import PrefixIndex

    server = make_server()
    pool = server.engine.engine.scheduler.kv.pool
    index = PrefixIndex()

    async def serve(prompt):
        await server.generate(GenerateRequest(prompt, SamplingParams(max_tokens=2)))
        report = RoutingReport.from_dict(await server.record_routing_stats())
        assert index.apply_report("r0", report, 0.0)
        assert set(index.reported_hashes("r0")) == set(pool.cached_hashes())
        return report

    async def main():
        first = await serve(list(range(1, 30)))
        second = await serve(list(range(40, 60)))
        assert await server.reset_prefix_cache()
        after_reset = await serve(list(range(70, 80)))
        return first, second, after_reset

    try:
        first, second, after_reset = asyncio.run(main())
    finally:
        server.shutdown()
    assert first.is_snapshot and len(first.cached_block_hashes) == 7 and first.report_seq == 1
    assert second.delta_base_seq == first.cache_seq and len(second.stored_block_hashes) == 5
    assert not second.cached_block_hashes and not second.removed_block_hashes
    assert after_reset.is_snapshot and len(after_reset.cached_block_hashes) == 2, "a reset is a gap"


def test_autoscaling_stats_see_the_queue_age_and_a_windowed_ttft_p90():
    # A fake clock: the held request's age grows before any first token exists (the autoscaler
    # sees queue time), its first token lands in the TTFT window, and the window forgets it.
    clock = FakeClock(100.0)
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(64, 4, 256, 300))
    server = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", replica_id="r0",
                       clock=clock, ttft_window_s=5.0)

    async def main():
        stream = server.generate_stream(GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=2)))
        await stream.__anext__()  # admitted, no token yet
        clock.advance(3.0)
        waiting = await server.record_autoscaling_stats()
        async for chunk in stream:
            if chunk.token_ids:
                break
        first = await server.record_autoscaling_stats()
        await stream.aclose()
        clock.advance(6.0)
        later = await server.record_autoscaling_stats()
        return waiting, first, later

    try:
        waiting, first, later = asyncio.run(main())
    finally:
        server.shutdown()
    assert waiting["oldest_wait_s"] == 3.0 and waiting["num_waiting_first_token"] == 1
    assert "ttft_p90_s" not in waiting
    assert first["ttft_p90_s"] == 3.0 and first["oldest_wait_s"] == 0.0 and first["num_waiting_first_token"] == 0
    assert "ttft_p90_s" not in later
    assert server.load_times_s["total"] >= 0


def test_model_info_limits_context_to_the_whole_cache():
    server = make_server(max_model_len=1024)
    try:
        info = asyncio.run(server.model_info())
    finally:
        server.shutdown()
    # The model takes 1024 positions, but 64 blocks of 4 tokens hold only 256.
    assert (info.served_model_name, info.max_model_len, info.block_size, info.vocab_size) == ("m", 256, 4, 300)


def test_health_check_raises_once_the_engine_thread_died():
    server = make_server()
    server.engine.shutdown()
    with pytest.raises(RuntimeError, match="stopped"):
        asyncio.run(server.check_health())


@pytest.mark.parametrize("admission,match", [
    ({"max_waiting_requests": 0}, "max_waiting_requests"),
    ({"batch_shed_fraction": 0}, "batch_shed_fraction"),
    ({"retry_after_s": 0}, "retry_after_s"),
])
def test_bad_admission_config_is_refused(admission, match):
    with pytest.raises(ValueError, match=match):
        replica_policy(**admission)


def test_batch_limit_is_a_fraction_of_the_interactive_one():
    config = replica_policy(max_waiting_requests=10, batch_shed_fraction=0.3)
    assert (config.limit(Priority.INTERACTIVE), config.limit(Priority.BATCH)) == (10, 3)


def test_engine_args_are_checked_by_name():
    assert _engine_config("/m", {"max_num_seqs": 8}).max_num_seqs == 8
    with pytest.raises(ValueError, match="unknown engine_args"):
        _engine_config(None, {"max_num_seq": 8})
    with pytest.raises(ValueError, match="given twice"):
        _engine_config("/a", {"model": "/b"})


@pytest.mark.parametrize("args,match", [
    ({"replicas": 2}, "unknown application args"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"max_queued_requests": 0}, "max_queued_requests"),
    ({"engine_args": [1]}, "engine_args"),
    ({"admission": {"max_waiting_requests": -1}}, "max_waiting_requests"),
])
def test_bad_application_args_are_refused_before_deploying(args, match):
    with pytest.raises(ValueError, match=match):
        AppArgs.parse(args)


def test_a_consumer_that_fell_behind_gets_the_backlog_as_one_chunk():
    server = make_server()
    tokens = reference_tokens([5, 6, 7, 8, 9], 20, 300)

    async def main():
        stream = server.generate_stream(GenerateRequest([5, 6, 7, 8, 9], SamplingParams(max_tokens=20, temperature=0,
                                                                                        ignore_eos=True)))
        admitted = await stream.__anext__()
        for _ in range(500):  # let the engine finish all 20 steps before reading any
            if (await server.engine.stats()).requests_finished["length"]:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # the last outputs reach this loop
        return admitted, [chunk async for chunk in stream]

    try:
        admitted, chunks = asyncio.run(main())
    finally:
        server.shutdown()
    assert admitted.token_ids == [] and admitted.num_prompt_tokens == 5
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].finish_reason == "length"
    assert chunks[0].token_ids == tokens and chunks[0].num_output_tokens == 20


def test_block_hashes_from_a_caller_with_another_block_size_are_a_400():
    from deployments.errors import APIError
    from model_worker.sched.hashing import hash_prompt_blocks

    server = make_server()
    prompt = list(range(1, 17))

    async def main():
        with pytest.raises(APIError) as caught:
            await server.generate(GenerateRequest(prompt, SamplingParams(max_tokens=2),
                                                  block_hashes=hash_prompt_blocks(prompt, 8)))
        whole = await server.generate(GenerateRequest(prompt, SamplingParams(max_tokens=2),
                                                      block_hashes=hash_prompt_blocks(prompt, 4)))
        return caught.value, whole

    try:
        error, whole = asyncio.run(main())
    finally:
        server.shutdown()
    assert (error.status, error.code, error.param) == (400, "invalid_block_hashes", "block_hashes")
    assert whole.finished and len(whole.token_ids) == 2


class ScriptedStream:
    """A request's outputs, each due at a time on the FakeClock. Waiting moves the clock: to the
    next output's time if it is due within the wait, else by the whole wait (a timeout). Only the
    consumer's waits move it, so every decision of the stream's coalescing is known exactly."""

    def __init__(self, clock: FakeClock, outputs: list[tuple[float, GenerationChunk]]) -> None:
        self.clock = clock
        self.outputs = collections.deque(outputs)
        self.closed = False

    async def next_within(self, timeout_s: float) -> GenerationChunk | None:
        await asyncio.sleep(0)
        if not self.outputs:
            raise StopAsyncIteration
        due_s, chunk = self.outputs[0]
        if due_s > self.clock() + timeout_s:
            self.clock.advance(timeout_s)
            return None
        self.clock.now_s = max(self.clock(), due_s)
        return self.outputs.popleft()[1]

    def ready(self) -> list[GenerationChunk]:
        taken = []
        while self.outputs and self.outputs[0][0] <= self.clock() and not (taken and taken[-1].finished):
            taken.append(self.outputs.popleft()[1])
        return taken

    def close(self) -> None:
        self.closed = True


class ScriptedEngine:
    """The engine surface LLMServer uses; each request added gets the next script's stream."""

    def __init__(self, clock: FakeClock, scripts: list[list[tuple[float, GenerationChunk]]]) -> None:
        self.limits = SimpleNamespace(max_num_seqs=8, max_model_len=256, num_kv_blocks=64, block_size=4)
        self.load_times_s: dict[str, float] = {}
        self.vocab_size = 300
        self.eos_token_ids = frozenset()
        self.clock = clock
        self.scripts = collections.deque(scripts)
        self.streams: list[ScriptedStream] = []

    def add_request(self, prompt_token_ids, params, **_) -> ScriptedStream:
        self.streams.append(ScriptedStream(self.clock, self.scripts.popleft()))
        return self.streams[-1]

    def seconds_since_alive(self) -> float:
        return 0.0

    def shutdown(self, timeout_s: float | None = None) -> None:
        pass


# Exact binary fractions, so every sum of times on the clock is exact: a token every 1/256 s.
TOKEN_S = 1 / 256
START_S = 1000.0


def token_script(tokens: list[int], late_index: int | None = None, late_s: float = 0.0,
                 progress_first: bool = False) -> list[tuple[float, GenerationChunk]]:
    """One output per token, TOKEN_S apart, the last one finished; token number late_index (from
    0) and every later one late_s late: the engine paused. progress_first: an output with no
    token (prompt progress only) half a token's time before the first."""
    script, due_s = [], START_S
    if progress_first:
        script.append((START_S + TOKEN_S / 2, GenerationChunk("r", num_prompt_tokens=3, num_cached_tokens=2)))
    for index, token in enumerate(tokens):
        due_s += TOKEN_S + (late_s if index == late_index else 0.0)
        last = index == len(tokens) - 1
        script.append((due_s, GenerationChunk("r", token_ids=[token], finished=last,
                                              finish_reason="length" if last else None,
                                              num_output_tokens=index + 1)))
    return script


def stream_chunks(tokens: list[int], stream_chunks_per_s: float, num_open_streams: int = 1,
                  max_stream_interval_s: float = 60.0, **script) -> list[tuple[float, list[int], bool]]:
    """(clock time, token ids, finished) of each content chunk of one stream, while
    num_open_streams - 1 other streams are open and idle (admitted, waiting for tokens)."""
    clock = FakeClock(START_S)
    scripts = [[] for _ in range(num_open_streams - 1)] + [token_script(tokens, **script)]
    engine = ScriptedEngine(clock, scripts)
    server = LLMServer(engine=engine, served_model_name="m", replica_id="r0", clock=clock,
                       stream_chunks_per_s=stream_chunks_per_s, max_stream_interval_s=max_stream_interval_s)

    async def main():
        held = [server.generate_stream(GenerateRequest([5, 6, 7], greedy_params(len(tokens))))
                for _ in range(num_open_streams - 1)]
        for stream in held:
            await stream.__anext__()  # admitted: it counts as an open stream from here
        assert server.num_open_streams == num_open_streams - 1
        chunks = []
        async for chunk in server.generate_stream(GenerateRequest([5, 6, 7], greedy_params(len(tokens)))):
            if chunk.token_ids:
                chunks.append((clock(), list(chunk.token_ids), chunk.finished))
        for stream in held:
            await stream.aclose()
        return chunks

    try:
        chunks = asyncio.run(main())
    finally:
        server.shutdown()
    assert server.num_open_streams == 0 and all(stream.closed for stream in engine.streams)
    return chunks


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


TOKENS = list(range(100, 140))


def due(index: int) -> float:
    """When token number index (from 0) comes out of the scripted engine."""
    return START_S + (index + 1) * TOKEN_S


def test_within_the_chunk_budget_every_token_goes_out_alone_when_it_comes():
    chunks = stream_chunks(TOKENS, stream_chunks_per_s=1e6)
    assert chunks == [(due(i), [token], i == len(TOKENS) - 1) for i, token in enumerate(TOKENS)]


def test_beyond_the_chunk_budget_tokens_are_folded_but_first_and_last_are_not_held():
    """4 open streams on a budget of 64 chunks/s: a stream sends at most every 4 / 64 = 1/16 s,
    16 tokens' time. The first token goes out alone at once, then a chunk of 16 tokens every
    1/16 s, and the last chunk as soon as the last token comes."""
    chunks = stream_chunks(TOKENS, stream_chunks_per_s=64, num_open_streams=4)
    assert chunks == [(due(0), TOKENS[:1], False), (due(16), TOKENS[1:17], False),
                      (due(32), TOKENS[17:33], False), (due(39), TOKENS[33:], True)]


def test_however_many_streams_are_open_none_waits_longer_than_the_longest_interval():
    """16 open streams on a budget of 64 chunks/s would send every 1/4 s, 64 tokens' time; with
    max_stream_interval_s 1/32 s a stream sends every 8 tokens' time, past the budget."""
    chunks = stream_chunks(TOKENS[:20], stream_chunks_per_s=64, num_open_streams=16, max_stream_interval_s=1 / 32)
    assert chunks == [(due(0), TOKENS[:1], False), (due(8), TOKENS[1:9], False), (due(16), TOKENS[9:17], False),
                      (due(19), TOKENS[17:20], True)]


def test_the_first_token_is_not_held_by_an_output_without_tokens_sent_just_before():
    chunks = stream_chunks(TOKENS[:3], stream_chunks_per_s=64, num_open_streams=4, progress_first=True)
    assert chunks == [(due(0), TOKENS[:1], False), (due(2), TOKENS[1:3], True)]


def test_the_interval_is_shared_by_every_open_stream():
    """The same budget and one stream alone: it may send every 1/64 s, 4 tokens' time."""
    chunks = stream_chunks(TOKENS[:12], stream_chunks_per_s=64)
    assert chunks == [(due(0), TOKENS[:1], False), (due(4), TOKENS[1:5], False), (due(8), TOKENS[5:9], False),
                      (due(11), TOKENS[9:12], True)]


def test_folded_tokens_go_out_when_their_interval_ends_even_if_the_engine_pauses():
    """Tokens 2 to 5 wait for the interval (1/16 s from the first token) while the engine pauses
    for 1/2 s: they go out at the interval's end, not with the next token. That one comes after a
    whole quiet interval and goes out at once; the last two are folded."""
    chunks = stream_chunks(TOKENS[:8], stream_chunks_per_s=64, num_open_streams=4, late_index=5, late_s=0.5)
    assert chunks == [(due(0), TOKENS[:1], False), (due(0) + 1 / 16, TOKENS[1:5], False),
                      (due(5) + 0.5, TOKENS[5:6], False), (due(7) + 0.5, TOKENS[6:8], True)]


def test_a_real_engine_beyond_the_chunk_budget_sends_every_token_once_and_in_order():
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(256, 4, 256, 300, step_delay_s=0.002))
    server = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", replica_id="r0",
                       stream_chunks_per_s=20)

    async def one(i):
        return [list(chunk.token_ids) async for chunk in
                server.generate_stream(GenerateRequest([5 + i, 6, 7], greedy_params(40))) if chunk.token_ids]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        streams = asyncio.run(main())
    finally:
        server.shutdown()
    for i, chunks in enumerate(streams):
        assert [t for c in chunks for t in c] == reference_tokens([5 + i, 6, 7], 40, 300)


def test_the_chunk_budget_must_be_positive():
    engine = AsyncLLMEngine(engine=LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(64, 4, 256, 300)))
    try:
        with pytest.raises(ValueError, match="stream_chunks_per_s"):
            LLMServer(engine=engine, served_model_name="m", stream_chunks_per_s=0)
        for bad in (0, -1.0, float("nan"), "1"):
            with pytest.raises(ValueError, match="max_stream_interval_s"):
                LLMServer(engine=engine, served_model_name="m", max_stream_interval_s=bad)
    finally:
        engine.shutdown()


def test_at_the_default_limits_the_replica_sheds_batch_from_128_waiting_and_everything_at_256():
    # Requests held at their admission chunk have no first token: each stays in the replica's queue.
    server = make_server()

    async def admit(n: int, priority: Priority, held: list) -> None:
        for _ in range(n):
            stream = server.generate_stream(GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=1),
                                                            priority=priority))
            await stream.__anext__()
            held.append(stream)

    async def refused(priority: Priority) -> APIError:
        with pytest.raises(APIError) as refusal:
            await admit(1, priority, [])
        return refusal.value

    async def main():
        held: list = []
        try:
            await admit(128, Priority.BATCH, held)
            batch = await refused(Priority.BATCH)
            await admit(128, Priority.INTERACTIVE, held)
            interactive = await refused(Priority.INTERACTIVE)
            stats = await server.record_autoscaling_stats()
            return batch, interactive, stats
        finally:
            for stream in held:
                await stream.aclose()

    try:
        batch, interactive, stats = asyncio.run(main())
    finally:
        server.shutdown()
    assert (batch.status, batch.code, interactive.status, interactive.code) == (429, "overloaded", 429, "overloaded")
    assert "batch limit 128" in batch.message and "max_waiting_requests=256" in interactive.message
    assert stats["num_waiting_first_token"] == 256 and stats["num_shed"] == 2
