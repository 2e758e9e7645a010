"""LLMServer's Serve hooks and configuration, over a real engine with the fake KV runner."""

from __future__ import annotations

import asyncio

import pytest

from contracts.serving import GenerateRequest
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


def _stream_chunks(stream_chunks_per_s: float, num_streams: int, max_tokens: int = 40) -> list[list[list[int]]]:
    """The token ids of each content chunk of each of num_streams concurrent streams."""
    engine = LLMEngine(EngineConfig(block_size=4),
                       model_runner=FakeKVRunner(256, 4, 256, 300, step_delay_s=0.002))
    server = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", replica_id="r0",
                       stream_chunks_per_s=stream_chunks_per_s)

    async def one(i):
        chunks = []
        async for chunk in server.generate_stream(GenerateRequest([5 + i, 6, 7], greedy_params(max_tokens))):
            if chunk.token_ids:
                chunks.append(list(chunk.token_ids))
        return chunks

    async def main():
        return await asyncio.gather(*(one(i) for i in range(num_streams)))

    try:
        return asyncio.run(main())
    finally:
        server.shutdown()


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_within_the_chunk_budget_every_token_goes_out_alone():
    for chunks, i in zip(_stream_chunks(stream_chunks_per_s=1e6, num_streams=2), range(2)):
        assert [t for c in chunks for t in c] == reference_tokens([5 + i, 6, 7], 40, 300)
        assert len(chunks) >= 35, "a consumer that keeps up gets (nearly) one chunk per token"


def test_beyond_the_chunk_budget_tokens_are_folded_but_first_and_last_are_not_held():
    """4 streams on a budget of 20 chunks/s: each stream sends at most every 0.2 s, while the
    engine makes a token every ~2 ms. The first token still goes out alone, every token arrives
    once and in order, and the whole stream is far fewer chunks."""
    for i, chunks in enumerate(_stream_chunks(stream_chunks_per_s=20, num_streams=4)):
        assert [t for c in chunks for t in c] == reference_tokens([5 + i, 6, 7], 40, 300)
        assert len(chunks[0]) == 1, "the first token is never held back"
        assert len(chunks) <= 6, [len(c) for c in chunks]


def test_the_chunk_budget_must_be_positive():
    engine = AsyncLLMEngine(engine=LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(64, 4, 256, 300)))
    try:
        with pytest.raises(ValueError, match="stream_chunks_per_s"):
            LLMServer(engine=engine, served_model_name="m", stream_chunks_per_s=0)
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
