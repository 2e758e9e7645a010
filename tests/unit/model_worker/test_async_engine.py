from __future__ import annotations

import asyncio
import time

import pytest

from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine, RequestRejected, SamplingParams
from tests.unit.fakes import ByteTokenizer, FakeKVRunner, reference_tokens, stats_once_aborted


def make_async(num_kv_blocks=512, block_size=4, vocab_size=1000, tokenizer=None, step_delay_s=0.001, **config):
    runner = FakeKVRunner(num_kv_blocks, block_size, vocab_size=vocab_size, step_delay_s=step_delay_s)
    engine = LLMEngine(EngineConfig(block_size=block_size, **config), model_runner=runner, tokenizer=tokenizer)
    return AsyncLLMEngine(engine=engine)


async def collect(engine, prompt, params, **kw):
    tokens, text, last = [], "", None
    async for out in engine.generate(prompt, params, **kw):
        tokens += out.token_ids
        text += out.text
        last = out
    return tokens, text, last


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_concurrent_streams_get_their_own_tokens():
    engine = make_async()

    async def main():
        prompts = [[3 + i, 4 + i, 5 + i] for i in range(12)]
        results = await asyncio.gather(*(collect(engine, p, greedy(5 + i)) for i, p in enumerate(prompts)))
        for i, (tokens, _, last) in enumerate(results):
            assert tokens == reference_tokens(prompts[i], 5 + i)
            assert last.finished and last.finish_reason == "length"
        stats = await engine.stats()
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_leaving_the_stream_early_aborts_and_frees_blocks():
    engine = make_async()

    async def main():
        seen = 0
        async for _ in engine.generate([5, 6, 7], greedy(1000 - 10), request_id="gone"):
            seen += 1
            if seen == 3:
                break
        stats = await stats_once_aborted(engine)
        assert stats.num_running == 0 and stats.requests_finished["abort"] == 1
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_cancelled_task_aborts_request():
    engine = make_async()

    async def main():
        task = asyncio.create_task(collect(engine, [5, 6], greedy(900), request_id="c"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await stats_once_aborted(engine)
        assert stats.requests_finished["abort"] == 1 and stats.num_running == 0

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_bad_requests_raise_before_streaming_and_leave_nothing():
    engine = make_async(num_kv_blocks=8)

    async def main():
        with pytest.raises(RequestRejected) as info:
            await collect(engine, [5] * 30, greedy(10))
        assert info.value.code == "context_length_exceeded"
        with pytest.raises(RequestRejected, match="vocabulary"):
            await collect(engine, [5, -1], greedy(2))
        stats = await engine.stats()
        assert stats.num_waiting == stats.num_running == 0
        tokens, _, _ = await collect(engine, [5, 6], greedy(3))
        assert len(tokens) == 3, "the engine still serves"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_text_streams_and_stop_string_ends_request():
    tokenizer = ByteTokenizer()
    engine = make_async(vocab_size=259, tokenizer=tokenizer)
    runner = engine.engine.runner
    for i, t in enumerate(tokenizer.encode("héllo wörld<END>tail")):
        runner.forced[("s", i)] = t

    async def main():
        _, text, last = await collect(engine, "say hi", greedy(40, stop=["<END>"]), request_id="s")
        assert text == "héllo wörld"
        assert last.finish_reason == "stop" and last.stop_reason == "<END>"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_tokens_the_core_made_after_a_stop_string_never_reach_the_consumer():
    """The stream side finds stop strings, so the engine loop steps on until the stop reaches it. A loop
    that falls behind (blocked here for 20 steps) must still see the text, tokens, counts and token
    times end exactly at the stop, as the engine alone would have ended them."""
    tokenizer = ByteTokenizer()
    engine = make_async(vocab_size=259, tokenizer=tokenizer, step_delay_s=0.002)
    runner = engine.engine.runner
    for i, t in enumerate(tokenizer.encode("abc<END>" + "x" * 60)):
        runner.forced[("late", i)] = t

    async def main():
        tokens, text, last = [], "", None
        async for out in engine.generate("go", greedy(60, stop=["<END>"]), request_id="late"):
            if not tokens:
                time.sleep(0.1)  # the event loop is busy: the engine loop runs ahead of the consumer
            tokens += out.token_ids
            text += out.text
            last = out
        assert text == "abc"
        assert tokens == tokenizer.encode("abc<END>")
        assert (last.finish_reason, last.stop_reason) == ("stop", "<END>")
        assert last.num_output_tokens == len(tokens) == len(last.timings.token_times_s)
        assert last.timings.finished_s == last.timings.token_times_s[-1]
        stats = await engine.stats()
        assert stats.requests_finished["stop"] == 1 and stats.num_running == 0
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_shutdown_ends_open_streams_with_an_error():
    from model_worker import EngineDeadError

    engine = make_async()

    async def main():
        stream = engine.generate([5, 6], greedy(900))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6], greedy(2))

    asyncio.run(main())


def test_a_resumed_request_continues_exactly_where_another_engine_stopped():
    """Migration: a second engine given the prompt and the first tokens produces the rest of the
    tokens and text of an uninterrupted run (held-back text of a split character or a possible
    stop string included), and counts every output token."""
    tokenizer = ByteTokenizer()
    prompt = [b + 3 for b in "resume héllo wörld".encode("utf-8")]

    async def main():
        whole = make_async(tokenizer=tokenizer, vocab_size=259)
        resumed_engine = make_async(tokenizer=tokenizer, vocab_size=259)
        try:
            params = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, stop=["zz"])
            tokens, text_after = [], []  # text_after[i]: text emitted once i + 1 tokens were out
            text = ""
            async for out in whole.generate(prompt, params):
                tokens += out.token_ids
                text += out.text
                text_after.append(text)
            for cut in (1, 5, 11):
                more, more_text, more_last = await collect(resumed_engine, prompt, params,
                                                           resumed_token_ids=tokens[:cut])
                assert tokens[:cut] + more == tokens
                assert text_after[cut - 1] + more_text == text
                assert more_last.num_output_tokens == len(tokens) and more_last.num_prompt_tokens == len(prompt)
        finally:
            whole.shutdown()
            resumed_engine.shutdown()

    asyncio.run(main())


def test_resumed_tokens_are_checked():
    engine = make_async()

    async def main():
        with pytest.raises(RequestRejected, match="nothing to generate"):
            engine.add_request([5, 6], greedy(3), resumed_token_ids=[7, 8, 9])
        with pytest.raises(RequestRejected, match="outside the vocabulary"):
            engine.add_request([5, 6], greedy(3), resumed_token_ids=[10**6])

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_next_within_returns_none_while_waiting_and_every_output_in_order():
    """LLMServer's keep-alives: a stream polled with a timeout yields None while no output comes,
    never loses or reorders one, and late timer ticks are never taken for outputs."""
    engine = make_async(step_delay_s=0.03)

    async def main():
        stream = engine.add_request([5, 6, 7], greedy(6))
        tokens, nones = [], 0
        while True:
            try:
                out = await stream.next_within(0.005)
            except StopAsyncIteration:
                break
            if out is None:
                nones += 1
                continue
            tokens += out.token_ids
            tokens += [t for later in stream.ready() for t in later.token_ids]
        assert tokens == reference_tokens([5, 6, 7], 6)
        assert nones >= 6  # steps are 30 ms, polls 5 ms

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
