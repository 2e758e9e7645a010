"""`iterserve simulate`: a workload through a simulated cluster, reported as `iterserve bench` reports.

    iterserve simulate --workload shared-prefix --rate 50 --num-requests 2000 --replicas 4,16 --router prefix_aware,pow2
    iterserve simulate --workload trace --rate 20 --autoscaling --max-replicas 16 --replica-start-s 60 --warm-spares 1
    iterserve simulate --workload trace --rate 40 --plan --slo-ttft 1.0 --slo-tpot 0.1 --max-replicas 64
    iterserve simulate profile --model tiny --out my-profile.json     # measure and fit a step-time profile

Each replica is our real Scheduler and admission, routed by our real router policy and scaled by
our real autoscaling decision; only the forward is a step-time model (--profile: a file from
`iterserve simulate profile`, or a shipped one by name). Writes results.jsonl, summary.json,
runs.json and report.md with plots into --out, as `iterserve bench` does. --plan finds the fewest
replicas whose run meets the SLO (p90 TTFT and p90 TPOT) by bisection.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autoscaler.policy import AutoscalerConfig
from loadtest.bench_cli import add_workload_arguments, build_workload, parse_rates, write_outputs
from loadtest.results import SLO, summarize
from simulator.cluster import ClusterConfig, SimCluster, SimRun, scheduler_config
from loadtest.traces import BenchRequest, normal_token_ids
from router.policy import POLICIES, RouterConfig

PROFILES_DIR = Path(__file__).parent / "profiles"


def load_step_model(name_or_path: str) -> Any:
    """A shipped profile by name (simulator/profiles/NAME.json) or a profile file."""
    from simulator.step_model import StepTimeModel

    path = Path(name_or_path)
    if not path.exists():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ValueError(f"no step-time profile {name_or_path!r}: give a file, or one of: {shipped}")
    return StepTimeModel.load(path)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="run a workload through a simulated cluster (or: simulate profile)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids of the generated prompts")
    p.add_argument("--profile", default="smollm2-cpu", help="step-time profile: a shipped name or a JSON file")
    p.add_argument("--replicas", default="1", help="replicas, or a comma list to compare")
    p.add_argument("--router", default="prefix_aware", help=f"routing policy ({', '.join(POLICIES)}), or a comma list")
    p.add_argument("--autoscaling", action="store_true", help="scale with our autoscaling policy from --replicas")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=8)
    p.add_argument("--warm-spares", type=int, default=0)
    p.add_argument("--target-queue", type=float, default=4.0, help="autoscaling: waiting requests per replica")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="autoscaling: TTFT p90 target, seconds")
    p.add_argument("--replica-start-s", type=float, default=30.0, help="seconds from asking for a replica to its first request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=4096, help="KV blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--report-period", type=float, default=1.0, help="seconds between a replica's routing reports")
    p.add_argument("--report-delay", type=float, default=0.0, help="seconds a report takes to reach the router")
    p.add_argument("--plan", action="store_true", help="find the fewest replicas (1..--max-replicas) meeting the SLO")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput and --plan: TTFT bound, seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput and --plan: TPOT bound, seconds")
    p.add_argument("--link-latency", type=float, default=0.0,
                   help="seconds from the router to a replica and from a request's end back to the router")
    p.add_argument("--workers", type=int, default=0,
                   help="worker processes holding the replicas (needs --link-latency > 0 and --report-delay >= it; "
                        "the same results as 0, one process)")
    p.add_argument("--max-duration", type=float, default=None,
                   help="simulated seconds per run before cutting off (default 3600; not with --workers)")
    p.add_argument("--label", default="sim", help="series name in the report")
    p.add_argument("--out", type=Path, default=Path("sim_out"))


def cluster_config(args: argparse.Namespace, replicas: int, policy: str) -> ClusterConfig:
    autoscaling = None
    if args.autoscaling:
        autoscaling = AutoscalerConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                       warm_spares=args.warm_spares, target_queue_per_replica=args.target_queue,
                                       ttft_slo_s=args.ttft_slo)
    limits = scheduler_config(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_model_len=args.max_model_len)
    return ClusterConfig(scheduler=limits, num_replicas=replicas, router=RouterConfig(policy=policy),
                         routing_stats_period_s=args.report_period, report_delay_s=args.report_delay,
                         autoscaling=autoscaling, replica_start_s=args.replica_start_s, seed=args.seed,
                         link_latency_s=args.link_latency)


def simulate(workload: list[BenchRequest], config: ClusterConfig, step_model: Any, label: str, series: str,
             rate: float | None, slo: SLO, max_duration_s: float | None, workers: int = 0) -> dict[str, Any]:
    """One simulated run: the run dict `iterserve bench` writes, with the simulator's counters."""
    started_s = time.perf_counter()
    if workers:
        from simulator.parallel import ParallelCluster

        if max_duration_s is not None:
            raise ValueError("--max-duration cuts a run off in one process only: leave it out with --workers")
        run: SimRun = ParallelCluster(config, step_model, workers).run(workload)
    else:
        run = SimCluster(config, step_model).run(workload, 3600.0 if max_duration_s is None else max_duration_s)
    wall_s = time.perf_counter() - started_s
    counters = dict(run.counters, wall_s=wall_s, wall_s_per_request=wall_s / max(len(workload), 1))
    return {"label": label, "series": series, "rate": rate, "concurrency": None,
            "summary": summarize(run.results, slo), "results": [r.to_dict() for r in run.results],
            "timeline": run.timeline, "decisions": run.decisions, "sim": counters}


def meets(summary: dict[str, Any], slo: SLO) -> bool:
    """Every request answered, p90 TTFT and p90 TPOT within the SLO's bounds."""
    if summary["num_ok"] < summary["num_requests"]:
        return False
    for bound, key in ((slo.ttft_s, "ttft_s"), (slo.tpot_s, "tpot_s")):
        value = summary[key]["p90"]
        if bound is not None and (value is None or value > bound):
            return False
    return True


def plan(workload: list[BenchRequest], args: argparse.Namespace, step_model: Any, policy: str, slo: SLO,
         rate: float | None) -> tuple[int | None, list[dict[str, Any]]]:
    """The fewest replicas in [1, max_replicas] whose run meets the SLO, by bisection (more replicas
    never make a run of the same requests slower under these policies), and the runs it took."""
    runs: dict[int, dict[str, Any]] = {}

    def run(n: int) -> bool:
        if n not in runs:
            runs[n] = simulate(workload, cluster_config(args, n, policy), step_model, f"{args.label} {policy} x{n}",
                               f"{policy} x{n}", rate, slo, args.max_duration, args.workers)
            print(summary_line(runs[n]), flush=True)
        return meets(runs[n]["summary"], slo)

    low, high = 1, args.max_replicas
    if not run(high):
        return None, [runs[n] for n in sorted(runs)]
    while low < high:
        middle = (low + high) // 2
        if run(middle):
            high = middle
        else:
            low = middle + 1
    return low, [runs[n] for n in sorted(runs)]


def summary_line(run: dict[str, Any]) -> str:
    from loadtest.bench_cli import summary_line as bench_line

    sim = run["sim"]
    return f"{bench_line(run)} | {sim['wall_s']:.1f} s wall, {sim['wall_s_per_request'] * 1e3:.2f} ms per request"


def run(args: argparse.Namespace) -> int:
    from loadtest.report import write_report

    if args.plan and (args.slo_ttft is None and args.slo_tpot is None):
        raise ValueError("--plan needs --slo-ttft and/or --slo-tpot")
    step_model = load_step_model(args.profile)
    pool = normal_token_ids(args.vocab_size, [])
    slo = SLO(args.slo_ttft, args.slo_tpot)
    policies = [p.strip() for p in args.router.split(",")]
    replica_counts = [int(n) for n in args.replicas.split(",")]
    notes = [f"command: iterserve {' '.join(sys.argv[1:])}", f"step-time profile: {args.profile}"]
    runs = []
    for rate in parse_rates(args.rate):
        workload = build_workload(args, np.asarray(pool), rate)
        for policy in policies:
            if args.plan:
                fewest, tried = plan(workload, args, step_model, policy, slo, rate)
                runs += tried
                notes.append(f"plan ({policy}, {rate} req/s): fewest replicas meeting the SLO: "
                             f"{fewest if fewest is not None else f'none up to {args.max_replicas}'}")
                print(notes[-1], flush=True)
                continue
            for n in replica_counts:
                label = f"{args.label} {policy} x{n}" + (f" @ {rate:g} req/s" if rate else "")
                runs.append(simulate(workload, cluster_config(args, n, policy), step_model, label, f"{policy} x{n}",
                                     rate, slo, args.max_duration, args.workers))
                print(summary_line(runs[-1]), flush=True)
    write_outputs(args.out, runs)
    report = write_report(args.out, f"iterserve simulate: {args.workload}", runs, notes=notes, slo_ttft_s=args.slo_ttft)
    print(f"report: {report}")
    return 0
