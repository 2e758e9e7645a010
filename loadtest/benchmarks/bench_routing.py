"""Prefix-aware routing against round-robin and power-of-two, over HTTP, on 3 replicas.

    python -m loadtest.benchmarks.bench_routing [--quick] [--out bench_results/routing]

For each policy the script deploys the iterserve application (the tiny model by default,
`--model`; 3 LLMServer replicas, the policy in `router:`) on one local Ray, replays the same
multi-turn workload whose conversations share K system prompts, and reads the replicas' prefix-cache counters from
/metrics. It also replays a workload with no sharing under the prefix-aware policy (does any
replica get too much?), and times the policy alone with 64 replicas. The last line is one JSON
object: per policy hit_rate, ttft_p50_s, ttft_p99_s, output_tokens_per_s; oracle_hit_rate (one
replica with an unbounded cache, computed from the workload); uniform_max_over_mean;
route_p99_ms_64.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest import workloads as wl
from loadtest.bench_cli import measure, summary_line, token_pool, write_outputs
from loadtest.client import ClientConfig
from loadtest.local_serve import start_local_serve, stop_local_serve
from loadtest.report import write_report
from loadtest.results import SLO
from loadtest.traces import BenchRequest
from model_worker.sched.hashing import hash_prompt_blocks
from router.policy import ReplicaSnapshot, RouterConfig, make_policy
from router.prefix_index import PrefixIndex

POLICIES = ("round_robin", "pow2", "prefix_aware")
REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer conversations (under 5 minutes)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=None, help="default 40; quick 16")
    # Chat sessions of 8 turns on 1024-token system prompts, each shared by a few conversations:
    # the last turn's prompt is 1,760 tokens, of which all but the new user message was sent before.
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.5, help="new conversations per second")
    # 320 blocks (5,120 tokens) per replica: 5 of the 8 system prompts, or 2-3 with their
    # conversations. A GPU's KV cache is bounded the same way against real traffic: routing by load
    # alone makes every replica hold every prefix and evict them in turn, routing by prefix holds
    # each prefix on one replica. 0 sizes the cache from memory (in effect unbounded here).
    p.add_argument("--kv-blocks", type=int, default=320, help="KV blocks per replica (default 320; 0: from memory)")
    p.add_argument("--model", default="tiny",
                   help="the model every replica serves (default: the tiny random model, so that replicas, "
                        "not this machine's cores, set the pace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "routing")
    args = p.parse_args(argv)
    args.conversations = args.conversations or (16 if args.quick else 40)
    return args


def shared_workload(args: argparse.Namespace, pool: np.ndarray) -> list[BenchRequest]:
    starts = wl.arrivals(args.conversations, args.rate, "poisson", args.seed)
    return wl.multi_turn(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.answer_tokens,
                         starts, pool, args.seed, think_time_s=0.2, num_system_prompts=args.system_prompts)


def uniform_workload(args: argparse.Namespace, pool: np.ndarray) -> list[BenchRequest]:
    n = args.conversations * 2
    length = wl.LengthDist("fixed", args.system_tokens, args.system_tokens, args.system_tokens)
    output = wl.LengthDist("fixed", args.answer_tokens, args.answer_tokens, args.answer_tokens)
    return wl.synthetic(n, length, output, wl.arrivals(n, args.rate * 2, "poisson", args.seed + 7), pool, args.seed + 7)


def oracle_hit_rate(workload: list[BenchRequest]) -> float:
    """Prompt tokens one replica with an unbounded cache would serve from cache, in send order
    (turns after their conversation's earlier turns). As the engine, a prompt's last token is
    always computed, so a fully cached prompt still computes its last block."""
    seen: set[int] = set()
    hit_tokens = total_tokens = 0
    for request in sorted(workload, key=lambda r: (r.after_id is not None, r.arrival_s)):
        hashes = hash_prompt_blocks(list(request.prompt_token_ids), BLOCK_SIZE)
        usable = (len(request.prompt_token_ids) - 1) // BLOCK_SIZE
        hits = 0
        for h in hashes[:usable]:
            if h not in seen:
                break
            hits += 1
        hit_tokens += hits * BLOCK_SIZE
        total_tokens += len(request.prompt_token_ids)
        seen.update(hashes)
    return hit_tokens / total_tokens


def route_p99_ms(num_replicas: int = 64, chain_blocks: int = 64, decisions: int = 5000, seed: int = 0) -> float:
    """The prefix-aware decision alone (index lookups for every replica, scoring, the dispatch
    record), with every replica holding 2,000 cached blocks."""
    rng = random.Random(seed)
    index = PrefixIndex()
    chains = [[rng.getrandbits(63) for _ in range(chain_blocks)] for _ in range(32)]
    for i in range(num_replicas):
        held = [h for chain in rng.sample(chains, 4) for h in chain[:rng.randrange(chain_blocks)]]
        index.update(f"r{i}", held + [rng.getrandbits(63) for _ in range(2000 - len(held))], 0.0)
    policy = make_policy(RouterConfig(), rng)
    snapshots = [ReplicaSnapshot(f"r{i}", rng.randrange(20), rng.randrange(500, 2000), 2000) for i in range(num_replicas)]
    times = []
    for d in range(decisions):
        chain = chains[d % len(chains)]
        started = time.perf_counter()
        hits = index.hits(chain, 1.0)  # as PrefixAwareRouter reads them: every holder in one walk
        chosen = policy.choose(snapshots, hits, len(chain), len(chain) + 4)
        index.record_dispatch(chosen, chain, 1.0)
        times.append(time.perf_counter() - started)
    return float(np.percentile(times, 99) * 1000)


def prefix_counters(base: str) -> tuple[dict[str, float], float, float]:
    """(requests finished per replica, prefix-cache hit tokens, query tokens) from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    per_replica: dict[str, float] = {}
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name == "iterserve_prefix_cache_hits_total":
            hits += float(value)
        elif name == "iterserve_prefix_cache_queries_total":
            queries += float(value)
        elif name == "iterserve_request_success_total":
            replica = name_labels.split('replica="', 1)[1].split('"', 1)[0]
            per_replica[replica] = per_replica.get(replica, 0.0) + float(value)
    return per_replica, hits, queries


def deploy(policy: str, replicas: int, kv_blocks: int | None, model: str | None) -> None:
    """A fresh application (new replicas, cold caches) with this routing policy."""
    from ray import serve

    from deployments.app import build_app

    serve.delete("iterserve")
    engine_args: dict[str, Any] = {"num_threads": 1}
    if kv_blocks:
        engine_args["num_kv_blocks"] = kv_blocks
    args = {"model": model, "num_replicas": replicas, "router": {"policy": policy}, "routing_stats_period_s": 0.5,
            "engine_args": engine_args, "admission": {"max_waiting_requests": 100_000}}
    serve.run(build_app(args), name="iterserve", route_prefix="/")


def run_policy(base: str, policy: str, workload: list[BenchRequest]) -> tuple[dict[str, Any], dict[str, Any]]:
    before, hits0, queries0 = prefix_counters(base)
    run = measure(workload, ClientConfig(base, max_duration_s=900), f"{policy}", policy, None, SLO())
    after, hits1, queries1 = prefix_counters(base)
    print(summary_line(run), flush=True)
    s = run["summary"]
    per_replica = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in after}
    figures = {"hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1.0), "ttft_p50_s": s["ttft_s"]["p50"],
               "ttft_p99_s": s["ttft_s"]["p99"], "output_tokens_per_s": s["output_throughput"],
               "requests_per_replica": sorted(per_replica.values(), reverse=True), "num_ok": s["num_ok"]}
    return run, figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    pool = token_pool(args.model)
    shared, uniform = shared_workload(args, pool), uniform_workload(args, pool)
    base = start_local_serve()
    runs, policies = [], {}
    try:
        for policy in POLICIES:
            deploy(policy, args.replicas, args.kv_blocks, args.model)
            run, policies[policy] = run_policy(base, policy, shared)
            runs.append(run)
            if policy == "prefix_aware":
                uniform_run, uniform_figures = run_policy(base, "prefix_aware (no sharing)", uniform)
                runs.append(uniform_run)
    finally:
        stop_local_serve()
    loads = uniform_figures["requests_per_replica"]
    headline = {"policies": policies, "oracle_hit_rate": oracle_hit_rate(shared),
                "uniform_max_over_mean": max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) else None,
                "uniform_requests_per_replica": loads, "route_p99_ms_64": route_p99_ms()}
    write_outputs(args.out, runs)
    notes = [f"command: python -m loadtest.benchmarks.bench_routing {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"{args.replicas} replicas; {args.conversations} conversations x {args.turns} turns, {args.system_prompts} "
             f"system prompts of {args.system_tokens} tokens, {args.user_tokens}-token user turns, "
             f"{args.answer_tokens}-token answers, {args.rate:g} new conversations/s; KV blocks per replica: "
             f"{args.kv_blocks or 'sized from memory'}",
             f"oracle hit rate {headline['oracle_hit_rate']:.3f}; "
             + "; ".join(f"{p} hit rate {f['hit_rate']:.3f}" for p, f in policies.items()),
             f"total wall time {time.monotonic() - started_s:.0f}s"]
    write_report(args.out, "Prefix-aware routing", runs, notes=notes)
    print(json.dumps(headline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
