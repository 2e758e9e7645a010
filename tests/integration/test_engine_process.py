"""The engine loop in a process of its own, on the tiny model: the same tokens and text as the
engine alone, stop strings cut exactly there, and no fault of the engine process (killed, failing
to load) or of its parent (killed) leaves a stream waiting or a process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from model_worker import AsyncLLMEngine, EngineConfig, EngineDeadError, LLMEngine, SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model=tiny_model_dir, dtype="float32", num_kv_blocks=256, num_threads=1)


@pytest.fixture(scope="module")
def engine(config):
    engine = AsyncLLMEngine(config)
    assert engine.core_pid is not None and engine.core_pid != os.getpid()
    try:
        yield engine
    finally:
        engine.shutdown()


def offline(config: EngineConfig, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, dict]:
    """What the engine alone gives for each request: tokens, text, the finished output."""
    engine = LLMEngine(config)
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results = {rid: {"tokens": [], "text": "", "last": None} for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            result = results[out.request_id]
            result["tokens"] += out.token_ids
            result["text"] += out.text
            result["last"] = out
    return results


async def served(engine: AsyncLLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, dict]:
    async def one(request_id, prompt, params):
        result = {"tokens": [], "text": "", "last": None}
        async for out in engine.generate(prompt, params, request_id=request_id):
            result["tokens"] += out.token_ids
            result["text"] += out.text
            result["last"] = out
        return request_id, result

    return dict(await asyncio.gather(*(one(rid, p, params) for rid, (p, params) in requests.items())))


def test_the_core_process_gives_what_the_engine_alone_gives(config, engine):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    requests = {f"r{i}": (f"request {i} says " * (i + 1), greedy) for i in range(8)}
    expected = offline(config, requests)
    got = asyncio.run(served(engine, requests))
    for request_id in requests:
        assert got[request_id]["tokens"] == expected[request_id]["tokens"]
        assert got[request_id]["text"] == expected[request_id]["text"]
        last = got[request_id]["last"]
        assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 24
        assert len(last.timings.token_times_s) == 24 and last.timings.ttft_s > 0


def test_a_stop_string_ends_the_text_and_the_counts_where_the_engine_alone_stops(config, engine):
    """The core keeps stepping while the stop travels to it: its tokens after the stop string
    never reach the consumer, nor its counts or token times."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = offline(config, {"probe": ("A stop string is", greedy)})["probe"]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    requests = {"s": ("A stop string is", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))}
    expected = offline(config, requests)["s"]
    got = asyncio.run(served(engine, requests))["s"]
    assert got["text"] == expected["text"] == text[:text.index(stop)]
    assert got["tokens"] == expected["tokens"]
    last = got["last"]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert last.num_output_tokens == expected["last"].num_output_tokens == len(got["tokens"])
    assert len(last.timings.token_times_s) == len(got["tokens"])

    async def stats():
        return await engine.stats()
    after = asyncio.run(stats())
    assert after.num_running == 0 and after.num_free_kv_blocks == after.num_total_kv_blocks
    assert after.requests_finished["stop"] >= 1


def test_stats_and_prefix_reset_are_answered_by_the_core(engine):
    async def main():
        stats = await engine.stats(include_block_hashes=True)
        assert stats.num_total_kv_blocks == 256 and isinstance(stats.cached_block_hashes, tuple)
        # The changes since a cache_seq cross from the engine process instead of every hash.
        delta = await engine.stats(include_block_hashes=True, block_hashes_since=stats.cache_seq)
        assert delta.block_hashes_since == stats.cache_seq and delta.cached_block_hashes is None
        assert delta.stored_block_hashes == delta.removed_block_hashes == ()
        assert await engine.reset_prefix_cache() is True
        assert (await engine.stats()).num_cached_kv_blocks == 0
        gap = await engine.stats(include_block_hashes=True, block_hashes_since=stats.cache_seq)
        assert gap.block_hashes_since is None and gap.cached_block_hashes == ()

    asyncio.run(main())


def test_a_killed_core_fails_its_streams_at_once_and_every_later_request(config):
    engine = AsyncLLMEngine(config)

    async def main():
        stream = engine.generate("killed mid-stream", SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.core_pid, signal.SIGKILL)

        async def drain():
            async for _ in stream:
                pass

        # A bound on a hang, not a speed check: the stream would otherwise wait for its 1000 tokens.
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.wait_for(drain(), timeout=60)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.add_request("after", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await engine.stats()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_the_core_exits_when_its_parent_is_killed(config):
    script = ("import sys, time\n"
              "from model_worker import AsyncLLMEngine, EngineConfig\n"
              f"engine = AsyncLLMEngine(EngineConfig(model={config.model!r}, dtype='float32', num_kv_blocks=64))\n"
              "print(engine.core_pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        core_pid = int(parent.stdout.readline())
        assert _alive(core_pid)
        parent.kill()
        parent.wait()
        deadline_s = time.monotonic() + 10
        while _alive(core_pid) and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert not _alive(core_pid), "the engine process outlived the process it served"
    finally:
        parent.kill()


def test_a_core_that_cannot_load_raises_and_leaves_no_process(tmp_path):
    before = _core_processes()
    with pytest.raises((RuntimeError, ValueError, OSError)):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path / "no-such-checkpoint")))
    time.sleep(0.5)
    assert _core_processes() <= before


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _core_processes() -> set[int]:
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"model_worker.engine.engine_process_main" in f.read() and _alive(int(name)):
                        found.add(int(name))
            except OSError:
                pass
    return found
