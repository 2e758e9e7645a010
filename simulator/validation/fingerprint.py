"""A fingerprint of simulated runs: to show that a change to the hot paths changed no result.

    python -m simulator.validation.fingerprint [--requests 200]

Seven runs: prefix-aware, power-of-two and round-robin over 4 replicas of a shared-prefix
multi-turn workload, each with 4,096 KV blocks and with 400 (preemption), and one autoscaling run
of Azure-trace lengths. Each line is a run and a hash of every request's status, first-token and
finish times, output tokens and last token times, and of every counter but the snapshot bytes
(a what-if figure, not a result). Run it before and after a change (git stash, or PYTHONPATH at
another checkout) and compare the lines: equal lines, the same results bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

from autoscaler.policy import AutoscalerConfig
from loadtest import workloads as wl
from simulator.validation.bench import scale_workload
from simulator.cli import load_step_model
from simulator.cluster import ClusterConfig, SimCluster, SimRun, scheduler_config
from loadtest.traces import normal_token_ids
from router.policy import RouterConfig


def digest(run: SimRun) -> str:
    h = hashlib.sha256()
    for r in run.results:
        h.update(repr((r.request_id, r.status, r.first_token_s, r.finish_s, r.output_tokens,
                       r.chunk_times_s[-3:] if r.chunk_times_s else None)).encode())
    h.update(repr(sorted((k, v) for k, v in run.counters.items() if k != "snapshot_bytes")).encode())
    return h.hexdigest()[:16]


def fingerprint(num_requests: int = 200, profile: str = "llama3-8b-h100") -> list[str]:
    step_model: Any = load_step_model(profile)
    pool = normal_token_ids(32000, [])
    starts = wl.arrivals(num_requests, 20.0, "poisson", 0)
    workload = wl.multi_turn(num_requests, 4, 1024, 64, 64, starts, pool, 0, think_time_s=0.5, num_system_prompts=6)
    lines = []
    for policy in ("prefix_aware", "pow2", "round_robin"):
        for blocks in (4096, 400):
            limits = scheduler_config(num_kv_blocks=blocks, max_num_seqs=64, max_num_batched_tokens=512)
            config = ClusterConfig(scheduler=limits, num_replicas=4, router=RouterConfig(policy=policy), seed=0)
            run = SimCluster(config, step_model).run(workload)
            lines.append(f"{policy} {blocks} {digest(run)} preemptions={run.counters['preemptions']:.0f}")
    autoscaling = AutoscalerConfig(min_replicas=1, max_replicas=6, warm_spares=1, target_queue_per_replica=8,
                                   ttft_slo_s=0.5)
    limits = scheduler_config(num_kv_blocks=2000, max_num_seqs=32, max_num_batched_tokens=1024)
    config = ClusterConfig(scheduler=limits, num_replicas=2, autoscaling=autoscaling, replica_start_s=5.0, seed=0)
    run = SimCluster(config, step_model).run(scale_workload(15 * num_requests, 60.0, 0))
    lines.append(f"autoscale {digest(run)} max_ready={max(d['ready'] for d in run.decisions)}")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="conversations (the autoscaling run has 15x)")
    args = p.parse_args(argv)
    if args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    lines = fingerprint(args.requests)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
