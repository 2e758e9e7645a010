"""What the simulator itself costs, part by part: the figures behind docs/simulator.md's "Scale".

    python -m simulator.validation.costs [--repeats 3]

1. decode: one replica, `--batch` requests decoding `--decode-tokens` tokens each, round-robin (no
   routing, no prefix lookups): wall microseconds per decoded token, the real Scheduler's step
   loop and the simulated replica around it.
2. request: one replica, Azure-trace lengths at 30 req/s (the scale run's per-replica load),
   prefix-aware: wall milliseconds per simulated request, everything included.
3. route: the prefix-aware policy's decision over tables of 1, 64 and 1,000 replicas.

Each figure is the best of --repeats runs (this machine's speed drifts with its neighbours; the
best is the least disturbed). The last line is one JSON object.

Every figure is a reading of `timer` around the work divided by the work counted (tokens the run
decoded, requests, decisions). The timer is an argument, so tests drive it by the work itself (a
tick per simulated step or decision) and check the figures exactly, without timing anything.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from simulator.validation.bench import scale_config, scale_workload
from simulator.cli import load_step_model
from simulator.cluster import SimCluster
from loadtest.traces import BenchRequest
from router.policy import Policy, ReplicaTable, RouterConfig, make_policy

Timer = Callable[[], float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=25, help="decoding requests in the decode part")
    p.add_argument("--decode-tokens", type=int, default=1500)
    p.add_argument("--requests", type=int, default=1800, help="requests in the request part (60 s at 30 req/s)")
    p.add_argument("--decisions", type=int, default=5000, help="routing decisions per table size")
    p.add_argument("--profile", default="llama3-8b-h100")
    args = p.parse_args(argv)
    for name in ("repeats", "batch", "decode_tokens", "requests", "decisions"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return args


def best_of(repeats: int, once: Callable[[], float]) -> float:
    return min(once() for _ in range(repeats))


def decode_us_per_token(args: argparse.Namespace, step_model: Any, timer: Timer = time.perf_counter) -> float:
    workload = [BenchRequest(f"d{i}", tuple(range(i * 100 + 1, i * 100 + 17)), args.decode_tokens, 0.0)
                for i in range(args.batch)]

    def once() -> float:
        started = timer()
        run = SimCluster(scale_config(1, "round_robin", 0), step_model).run(workload)
        return (timer() - started) / run.counters["tokens"] * 1e6

    return best_of(args.repeats, once)


def request_ms(args: argparse.Namespace, step_model: Any, timer: Timer = time.perf_counter) -> float:
    workload = scale_workload(args.requests, 30.0, seed=0)

    def once() -> float:
        started = timer()
        SimCluster(scale_config(1, "prefix_aware", 0), step_model).run(workload)
        return (timer() - started) / len(workload) * 1e3

    return best_of(args.repeats, once)


def route_us(args: argparse.Namespace, num_replicas: int, timer: Timer = time.perf_counter,
             policy: Policy | None = None) -> float:
    """Decisions over a table as the scale run's look: similar loads, most of the cache free, one
    replica holding the first 10 of the request's 15 blocks. `policy`: the prefix-aware one unless
    given."""
    rng = np.random.default_rng(0)
    table = ReplicaTable([f"r{i:04d}" for i in range(num_replicas)], rng.integers(20, 26, num_replicas),
                         rng.integers(3000, 8000, num_replicas), np.full(num_replicas, 8192))
    policy = policy or make_policy(RouterConfig(policy="prefix_aware"), random.Random(0))
    hits = {"r0000": 10}

    def once() -> float:
        started = timer()
        for _ in range(args.decisions):
            policy.choose(table, hits, 15, 22)
        return (timer() - started) / args.decisions * 1e6

    return best_of(args.repeats, once)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    step_model = load_step_model(args.profile)
    result: dict[str, Any] = {"repeats": args.repeats, "batch": args.batch}
    result["decode_us_per_token"] = round(decode_us_per_token(args, step_model), 2)
    result["request_ms_1_replica"] = round(request_ms(args, step_model), 3)
    for n in (1, 64, 1000):
        result[f"route_us_{n}_replicas"] = round(route_us(args, n), 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
