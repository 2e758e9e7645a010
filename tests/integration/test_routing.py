"""The prefix-aware router on a real local Ray with three LLMServer replicas."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import numpy as np
import pytest

from contracts.sampling import SamplingParams
from contracts.serving import GenerateRequest
from model_worker.sched.hashing import hash_prompt_blocks

pytestmark = pytest.mark.integration

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    args = {"model": tiny_model_dir, "num_replicas": 3, "routing_stats_period_s": 0.5,
            "engine_args": {"num_threads": 1, "max_num_seqs": 32, "dtype": "float32"}, "router": {"policy": "prefix_aware"}}
    serve.run(build_app(args), name="iterserve", route_prefix=None)
    try:
        yield serve.get_deployment_handle("LLMServer", "iterserve")
    finally:
        serve.shutdown()
        ray.shutdown()


def request(prompt: list[int], max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           hash_prompt_blocks(prompt, BLOCK))


def prompts_with_prefixes(num_prefixes: int, per_prefix: int, seed: int) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(10, 4000, 12 * BLOCK).tolist() for _ in range(num_prefixes)]
    return [(k, prefixes[k] + rng.integers(10, 4000, 20).tolist()) for _ in range(per_prefix)
            for k in range(num_prefixes)]


async def serve_all(llm, prompts: list[list[int]], concurrency: int = 4) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            return await llm.generate.remote(request(prompt))
    return await asyncio.gather(*(one(p) for p in prompts))


def test_requests_sharing_a_prefix_stick_to_one_replica(llm):
    work = prompts_with_prefixes(num_prefixes=3, per_prefix=8, seed=1)
    results = asyncio.run(serve_all(llm, [p for _, p in work]))
    by_prefix: dict[int, Counter] = {}
    for (k, _), result in zip(work, results):
        assert result.finished and result.num_output_tokens == 4
        by_prefix.setdefault(k, Counter())[result.replica_id] += 1
    for k, counts in by_prefix.items():
        assert counts.most_common(1)[0][1] >= 7, (k, counts)  # at most one request strays
    hits = sum(r.num_cached_tokens for r in results)
    assert hits >= 0.8 * (3 * 7 * 12 * BLOCK), hits  # all but each prefix's first request hit 12 blocks


def test_a_burst_without_sharing_spreads_over_the_replicas(llm):
    """Thirty requests at once, none sharing a block: every decision of the burst comes before the
    first send, so the router must count its own choices as load."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 4000, 40).tolist() for _ in range(30)]
    results = asyncio.run(serve_all(llm, prompts, concurrency=30))
    counts = Counter(r.replica_id for r in results)
    assert len(counts) == 3 and max(counts.values()) <= 15, counts  # at most 1.5x the mean of 10


def test_a_killed_replica_is_dropped_and_the_rest_succeed(llm):
    import ray

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "LLMServer" in a["name"]]
    assert len(replicas) == 3
    victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    victim_id = replicas[0]["name"].rsplit("#", 1)[-1]
    ray.kill(victim, no_restart=True)
    time.sleep(1.0)
    work = prompts_with_prefixes(num_prefixes=4, per_prefix=6, seed=2)
    results = asyncio.run(serve_all(llm, [p for _, p in work]))
    assert all(r.finished and r.num_output_tokens == 4 for r in results)
    assert victim_id not in {r.replica_id for r in results}
