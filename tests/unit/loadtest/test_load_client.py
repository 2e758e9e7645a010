"""The load generator against a real HTTP server on loopback: uvicorn serving the OpenAI frontend
over an LLMServer whose engine runs the fake KV runner (no torch, no Ray)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn

from deployments.frontend import OpenAIFrontend
from deployments.llm_server import LLMServer
from deployments.local_backend import LocalBackend
from loadtest import workloads as wl
from loadtest.client import ClientConfig, queue_sample, run_load
from loadtest.traces import BenchRequest
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine
from tests.unit.fakes import ChatByteTokenizer, FakeKVRunner

POOL = np.arange(3, 259)


@pytest.fixture
def server():
    """Yields (base_url, LLMServer); the engine steps take 2 ms so streams take real time."""
    runner = FakeKVRunner(512, 4, 1024, 259, step_delay_s=0.002)
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=runner, tokenizer=ChatByteTokenizer())
    llm = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="fake",
                    admission={"max_waiting_requests": 40, "batch_shed_fraction": 0.05})
    app = OpenAIFrontend(LocalBackend(llm), ChatByteTokenizer).asgi_app()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not http.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", llm
    finally:
        http.should_exit = True
        thread.join(10)
        llm.shutdown()


def requests(n: int, output_tokens: int = 12, gap_s: float = 0.01) -> list[BenchRequest]:
    rng = np.random.default_rng(0)
    return [BenchRequest(f"r{i}", tuple(int(t) for t in rng.choice(POOL, 20)), output_tokens, i * gap_s)
            for i in range(n)]


def test_open_loop_measures_every_request(server):
    base, _ = server
    run = asyncio.run(run_load(requests(10), ClientConfig(base, sample_interval_s=0.05)))
    assert len(run.results) == 10 and all(r.ok for r in run.results)
    for r in run.results:
        assert r.output_tokens == 12 and r.prompt_tokens == 20
        assert r.sent_s >= r.arrival_s  # never sent early
        assert r.sent_s < r.first_token_s <= r.chunk_times_s[-1] <= r.finish_s
        assert r.chunk_times_s == sorted(r.chunk_times_s) and 1 <= len(r.chunk_times_s) <= 12
    assert run.timeline and {"num_waiting", "num_running", "kv_usage", "replicas"} <= set(run.timeline[0])


def test_refusals_are_recorded_with_their_status(server):
    base, llm = server
    llm.engine.engine.runner.step_delay_s = 0.05  # slow steps: the 30 requests queue up for sure
    workload = [BenchRequest(r.request_id, r.prompt_token_ids, 10, 0.0, priority="batch") for r in requests(30)]
    run = asyncio.run(run_load(workload, ClientConfig(base, sample_interval_s=0)))
    shed = [r for r in run.results if r.status == 429]
    assert len(run.results) == 30 and shed and any(r.ok for r in run.results)
    assert all("overloaded" in r.error for r in shed)


def test_closed_loop_keeps_the_concurrency_bound(server):
    base, _ = server
    workload = [BenchRequest(r.request_id, r.prompt_token_ids, 30, 0.0) for r in requests(12)]
    run = asyncio.run(run_load(workload, ClientConfig(base, mode="closed", concurrency=3, sample_interval_s=0)))
    assert all(r.ok for r in run.results)
    events = sorted([(r.sent_s, 1) for r in run.results] + [(r.finish_s, -1) for r in run.results],
                    key=lambda e: (e[0], e[1]))
    in_flight = np.cumsum([delta for _, delta in events])
    assert in_flight.max() == 3


def test_conversation_turns_wait_for_the_previous_one(server):
    base, _ = server
    workload = wl.multi_turn(3, 3, 16, 8, 6, [0.0, 0.0, 0.0], POOL, seed=2, think_time_s=0.05)
    run = asyncio.run(run_load(workload, ClientConfig(base, sample_interval_s=0)))
    by_id = {r.request_id: r for r in run.results}
    for request in workload:
        assert by_id[request.request_id].ok
        if request.after_id is not None:
            assert by_id[request.request_id].sent_s >= by_id[request.after_id].finish_s + 0.05


def test_time_limit_cuts_off_and_still_records_everything(server):
    base, llm = server
    workload = [BenchRequest("long", tuple(range(3, 23)), 900, 0.0), BenchRequest("late", (5, 6, 7), 4, 30.0)]
    run = asyncio.run(run_load(workload, ClientConfig(base, max_duration_s=0.5, sample_interval_s=0)))
    by_id = {r.request_id: r for r in run.results}
    assert "cut off" in by_id["long"].error and by_id["long"].finish_s is None
    assert by_id["late"].sent_s is None and "not sent" in by_id["late"].error
    assert run.duration_s < 10


def test_only_loopback_unless_allowed():
    with pytest.raises(ValueError, match="loopback"):
        ClientConfig("http://10.1.2.3:8000")
    assert ClientConfig("http://10.1.2.3:8000", allow_remote=True).base_url.startswith("http://10.")
    ClientConfig("http://localhost:8000")
    ClientConfig("http://[::1]:8000")
    with pytest.raises(ValueError, match="unique"):
        asyncio.run(run_load([BenchRequest("a", (5,), 1, 0.0), BenchRequest("a", (6,), 1, 0.0)], ClientConfig()))


def test_queue_sample_sums_replicas_and_averages_kv_usage():
    text = """# TYPE iterserve_num_requests_waiting gauge
iterserve_num_requests_waiting{model_name="m",replica="a"} 3
iterserve_num_requests_waiting{model_name="m",replica="b"} 4
iterserve_num_requests_running{model_name="m",replica="a"} 10
iterserve_kv_cache_usage_perc{model_name="m",replica="a"} 0.5
iterserve_kv_cache_usage_perc{model_name="m",replica="b"} 0.25
iterserve_replicas{model_name="m",state="RUNNING"} 2
iterserve_replicas{model_name="m",state="STARTING"} 1
"""
    assert queue_sample(text) == {"num_waiting": 7.0, "num_running": 10.0, "kv_usage": 0.375, "replicas": 2.0}
