"""The simulator checked against the real engine, then run where the real system cannot go.

    python -m simulator.validation.bench [--quick] [--out bench_results/sim]

1. validation: the same Azure-trace requests through our real engine (the tiny model, offline,
   this machine's cores) and through one simulated replica with the tiny model's measured CPU
   profile: TTFT p50/p99, TPOT p50 and throughput side by side, and the worst relative error.
2. scale: `--scale-replicas` replicas (1,000) and `--scale-requests` requests (1,000,000; quick:
   64 and 20,000) of the Azure trace on the H100 profile, the replicas in `--scale-workers` worker
   processes (2; simulator.parallel), the simulator's wall time per request.
3. routing at scale: a shared-prefix workload through 64, 256 and 1,000 replicas (quick: 16, 64)
   under prefix-aware, power-of-two and round-robin routing: prefix hit rate, TTFT p50/p99.
4. warm spares: a 4x step in load with replicas that take 60 s to start, warm_spares 0, 1, 2:
   seconds until TTFT p90 is back under the SLO after the step.
5. report traffic: routing-report bytes per replica per second in the routing runs.
The last line is one JSON object (`validation_max_rel_error`, `scale_replicas`, `scale_requests`,
`scale_wall_s`, ...; `quick` says when sizes were scaled down).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autoscaler.policy import AutoscalerConfig
from loadtest import workloads as wl
from loadtest.results import finite, summarize
from simulator.cli import load_step_model
from simulator.cluster import ClusterConfig, SimCluster, scheduler_config
from simulator.parallel import ParallelCluster
from loadtest.traces import (BenchRequest, LengthScaler, default_trace_path, load_azure_trace, normal_token_ids,
                             sample_lengths)
from router.policy import RouterConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller runs (a few minutes)")
    p.add_argument("--validation-requests", type=int, default=None, help="default 300; quick 100")
    p.add_argument("--validation-rate", type=float, default=3.0, help="req/s offered to the one real engine")
    p.add_argument("--validation-profile", default="here",
                   help="the tiny model's step-time profile for the validation: 'here' measures one on this machine "
                        "first (a shipped profile describes the machine it was measured on), else a shipped name or a "
                        "JSON file")
    p.add_argument("--scale-replicas", type=int, default=None, help="default 1000; quick 64")
    p.add_argument("--scale-requests", type=int, default=None, help="default 1,000,000; quick 20,000")
    p.add_argument("--scale-rate", type=float, default=30.0,
                   help="req/s per replica in the scale run (30: a batch of about 25 on the H100 profile)")
    p.add_argument("--scale-workers", type=int, default=2,
                   help="worker processes holding the scale run's replicas (simulator.parallel); 0: all in one process")
    p.add_argument("--routing-replicas", default=None, help="default 64,256,1000; quick 16,64")
    p.add_argument("--gpu-profile", default="llama3-8b-h100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "sim")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    args = p.parse_args(argv)
    args.parts = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    args.validation_requests = args.validation_requests or (100 if args.quick else 300)
    args.scale_replicas = args.scale_replicas or (64 if args.quick else 1000)
    args.scale_requests = args.scale_requests or (20_000 if args.quick else 1_000_000)
    if args.scale_workers < 0:
        p.error("--scale-workers must be >= 0")
    args.routing_replicas = [int(n) for n in (args.routing_replicas or ("16,64" if args.quick else "64,256,1000")).split(",")]
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def figures(summary: dict[str, Any]) -> dict[str, float | None]:
    return {"ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "output_tokens_per_s": summary["output_throughput"]}


def rel_errors(real: dict[str, float | None], sim: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (abs(sim[k] - real[k]) / real[k] if real[k] and sim[k] is not None else None) for k in real}


def trace_workload(num_requests: int, rate: float, pool: np.ndarray, seed: int) -> list[BenchRequest]:
    rows = load_azure_trace(default_trace_path())
    scaler = LengthScaler(prompt_divisor=4.0, output_divisor=2.0)
    return wl.trace_replay(rows, num_requests, pool, seed, speedup=rate / wl.trace_rate(rows, num_requests), scaler=scaler)


# ---- 1. validation against the real engine ------------------------------------------------------

def validation(args: argparse.Namespace, step_model: Any = None) -> dict[str, Any]:
    """The tiny model's real engine, offline on this machine, against one simulated replica with the
    same scheduler limits and the profile measured from that engine's runner.

    The profile times the runner's forward alone; a real step also pays the host's work between
    forwards (the scheduler, and the offline driver's handling of each step's outputs). That cost
    per step is measured once, on a separate calibration run of other requests (another seed), and
    given to the simulator as step_overhead_s; the compared run is not used to tune anything."""
    from contracts.sampling import SamplingParams
    from loadtest.engine_driver import run_engine
    from model_worker.config import EngineConfig
    from model_worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=2048), detokenize=False)
    pool = normal_token_ids(engine.vocab_size, engine.runner.eos_token_ids)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def real_run(workload: list[BenchRequest]) -> tuple[list, float]:
        """Results, and host seconds per step outside the runner (wall, less idle sleeps, less
        the runner's execute time, over the steps)."""
        engine.reset_prefix_cache()
        slept = [0.0]

        def sleep(seconds: float) -> None:
            slept[0] += seconds
            time.sleep(seconds)

        steps, execute_s = engine.num_steps, engine.runner.execute_time_s
        started_s = time.perf_counter()
        results = run_engine(engine, workload, params, sleep=sleep)
        wall_s = time.perf_counter() - started_s
        num_steps = engine.num_steps - steps
        return results, (wall_s - slept[0] - (engine.runner.execute_time_s - execute_s)) / max(num_steps, 1)

    # The calibration run warms the engine up too.
    _, overhead_s = real_run(trace_workload(max(40, args.validation_requests // 3), args.validation_rate, pool,
                                            args.seed + 1))
    workload = trace_workload(args.validation_requests, args.validation_rate, pool, args.seed)
    started_s = time.perf_counter()
    real_results, overhead_check_s = real_run(workload)
    real_wall_s = time.perf_counter() - started_s
    config = ClusterConfig(scheduler=engine.scheduler.config, num_replicas=1, step_overhead_s=max(overhead_s, 0.0),
                           seed=args.seed)
    sim_run = SimCluster(config, step_model or load_step_model("tiny-cpu")).run(workload)
    real, sim = figures(summarize(real_results)), figures(summarize(sim_run.results))
    errors = rel_errors(real, sim)
    log(f"validation: host overhead {overhead_s * 1e3:.2f} ms/step (compared run: {overhead_check_s * 1e3:.2f}); "
        f"real {real} sim {sim}")
    return {"requests": len(workload), "rate": args.validation_rate, "real": real, "sim": sim, "rel_error": errors,
            "max_rel_error": max(e for e in errors.values() if e is not None), "real_wall_s": real_wall_s,
            "step_overhead_s": overhead_s, "step_overhead_s_in_compared_run": overhead_check_s}


def validation_profile(args: argparse.Namespace) -> Any:
    """The named profile, or ('here') one measured now from the tiny model's runner: a grid of step
    shapes and the steps of a short real run of other requests, as the integration test does."""
    if args.validation_profile != "here":
        return load_step_model(args.validation_profile)
    from simulator.step_model import fit, measure_profile, measure_trace_steps

    started_s = time.perf_counter()
    grid = measure_profile("tiny", quick=args.quick, log=lambda line: None)
    trace = measure_trace_steps("tiny", num_requests=40, log=lambda line: None)
    model = fit(grid.points + trace, objective="absolute", model="tiny", device="cpu")
    log(f"validation: profile measured here in {time.perf_counter() - started_s:.0f} s, {len(grid.points + trace)} steps")
    return model


# ---- 2. scale --------------------------------------------------------------------------------

def scale_workload(num_requests: int, rate: float, seed: int) -> list[BenchRequest]:
    """The Azure trace's lengths drawn with replacement (it has 19,366 rows), Poisson arrivals.
    Prompts are slices of one shared random token tuple at random offsets: a million prompts of
    their own would be about 10 GB of Python ints, slices are 8 bytes a token, and random offsets
    share no block (the trace has no shared prefixes either)."""
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(load_azure_trace(default_trace_path()), num_requests,
                             LengthScaler(prompt_divisor=4.0, output_divisor=2.0), seed)
    tokens = tuple(int(t) for t in rng.integers(1, 32000, size=1 << 20))
    longest = max(p for p, _ in lengths)
    offsets = rng.integers(0, len(tokens) - longest, size=num_requests)
    arrivals = wl.arrivals(num_requests, rate, "poisson", seed)
    return [BenchRequest(f"req-{i}", tokens[o:o + p], n, a)
            for i, ((p, n), o, a) in enumerate(zip(lengths, offsets.tolist(), arrivals))]


# The scale run's link between router and replicas (a handle's call, a reply): 1 ms each way, and
# reports 1 ms late. It is also the window a parallel run's processes run without each other.
SCALE_LINK_S = 0.001


def scale_config(num_replicas: int, policy: str, seed: int) -> ClusterConfig:
    """The scale run's deployment: H100-sized KV caches and scheduler limits."""
    limits = scheduler_config(num_kv_blocks=8192, max_num_seqs=256, max_num_batched_tokens=2048)
    return ClusterConfig(scheduler=limits, num_replicas=num_replicas, router=RouterConfig(policy=policy), record_token_times=False, seed=seed,
                         link_latency_s=SCALE_LINK_S, report_delay_s=SCALE_LINK_S)


def scale(args: argparse.Namespace, step_model: Any) -> dict[str, Any]:
    """Azure-trace requests over many replicas at --scale-rate each, prefix-aware routing; the
    replicas in --scale-workers processes (the same results as in one)."""
    replicas, requests = args.scale_replicas, args.scale_requests
    per_replica_rate = args.scale_rate
    started_s = time.perf_counter()
    workload = scale_workload(requests, replicas * per_replica_rate, args.seed)
    build_s = time.perf_counter() - started_s
    config = scale_config(replicas, "prefix_aware", args.seed)
    started_s = time.perf_counter()
    workers = args.scale_workers
    cluster = ParallelCluster(config, step_model, workers) if workers else SimCluster(config, step_model)
    run = cluster.run(workload)
    wall_s = time.perf_counter() - started_s
    summary = summarize(run.results)
    log(f"scale: {replicas} replicas, {requests} requests, {workers or 'no'} worker processes: {wall_s:.0f} s wall "
        f"({wall_s / requests * 1e3:.2f} ms/request)")
    return {"replicas": replicas, "requests": requests, "workers": workers, "wall_s": wall_s, "workload_build_s": build_s,
            "wall_ms_per_request": wall_s / requests * 1e3, "simulated_s": run.duration_s,
            "steps": run.counters["steps"], "events": run.counters["events"], **figures(summary),
            "num_ok": summary["num_ok"]}


# ---- 3. routing at scale ---------------------------------------------------------------------

def routing(args: argparse.Namespace, step_model: Any) -> dict[str, Any]:
    """Shared-prefix multi-turn conversations (K system prompts each shared by many users), load
    scaled with the replica count; KV caches of 4,096 blocks hold a few prefixes each. The
    prefix-aware run also counts what each of its reports would have cost as a snapshot, which is
    what a run with a snapshot in every report sends (the routing is the same:
    tests/unit/simulator/test_cluster.py)."""
    out: dict[str, Any] = {}
    pool = normal_token_ids(32000, [])
    for replicas in args.routing_replicas:
        conversations = (10 if args.quick else 20) * replicas
        arrivals = wl.arrivals(conversations, 2.0 * replicas, "poisson", args.seed)
        workload = wl.multi_turn(conversations, 4, 1024, 64, 64, arrivals, pool, args.seed, think_time_s=2.0,
                                 num_system_prompts=max(8, replicas // 2))
        row: dict[str, Any] = {}
        for policy in ("prefix_aware", "pow2", "round_robin"):
            limits = scheduler_config(num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=2048)
            config = ClusterConfig(scheduler=limits, num_replicas=replicas, router=RouterConfig(policy=policy),
                                   record_token_times=False, seed=args.seed)
            started_s = time.perf_counter()
            run = SimCluster(config, step_model).run(workload)
            wall_s = time.perf_counter() - started_s
            counters = run.counters
            per_replica_s = replicas * max(run.duration_s, 1e-9)
            row[policy] = {**figures(summarize(run.results)), "hit_rate": counters["cached_tokens"] / counters["prompt_tokens"],
                           "report_bytes_per_replica_s": counters["report_bytes"] / per_replica_s,
                           "snapshot_bytes_per_replica_s": counters.get("snapshot_bytes", 0.0) / per_replica_s,
                           "wall_s": wall_s, "requests": len(workload)}
            log(f"routing x{replicas} {policy}: {row[policy]}")
        row["report_bytes_per_replica_s_full"] = row["prefix_aware"]["snapshot_bytes_per_replica_s"]
        row["report_bytes_per_replica_s_delta"] = row["prefix_aware"]["report_bytes_per_replica_s"]
        log(f"routing x{replicas} reports: full {row['report_bytes_per_replica_s_full']:.0f} B/s, "
            f"delta {row['report_bytes_per_replica_s_delta']:.0f} B/s per replica")
        out[str(replicas)] = row
    return out


# ---- 4. warm spares ----------------------------------------------------------------------------

def ttft_p90_bins(results: list, bin_s: float) -> list[tuple[float, float]]:
    """(bin start, TTFT p90) per bin of arrival times."""
    bins: dict[int, list[float]] = {}
    for r in results:
        if r.ttft_s is not None:
            bins.setdefault(int(r.arrival_s // bin_s), []).append(r.ttft_s)
    return [(index * bin_s, float(np.percentile(bins[index], 90))) for index in sorted(bins)]


def recovery_s(results: list, step_s: float, slo_s: float, bin_s: float = 5.0) -> float | None:
    """Seconds after the step until every later bin of arrivals has its TTFT p90 within the SLO."""
    bins: dict[int, list[float]] = {}
    for r in results:
        if r.arrival_s >= step_s and r.ttft_s is not None:
            bins.setdefault(int((r.arrival_s - step_s) // bin_s), []).append(r.ttft_s)
    if not bins:
        return None
    last_bad = -1
    for index in sorted(bins):
        if float(np.percentile(bins[index], 90)) > slo_s:
            last_bad = index
    return (last_bad + 1) * bin_s


def warm_spares(args: argparse.Namespace, step_model: Any) -> dict[str, Any]:
    """1x for 120 s, then 4x for 600 s; a replica takes 60 s to start."""
    pool = normal_token_ids(32000, [])
    base_rate, phases = 8.0, [(120.0, 8.0), (600.0 if not args.quick else 300.0, 32.0)]
    times = wl.step_arrivals(phases, args.seed)
    fixed = lambda n: wl.LengthDist("fixed", n, n, n)  # noqa: E731
    workload = wl.synthetic(len(times), fixed(512), fixed(128), times, pool, args.seed)
    out: dict[str, Any] = {"base_rate": base_rate, "step_at_s": phases[0][0], "replica_start_s": 60.0, "slo_s": 1.0}
    for spares in (0, 1, 2):
        autoscaling = AutoscalerConfig(min_replicas=1, max_replicas=16, warm_spares=spares,
                                       target_queue_per_replica=8, ttft_slo_s=1.0, scale_down_delay_s=120.0)
        limits = scheduler_config(num_kv_blocks=8192, max_num_seqs=32, max_num_batched_tokens=2048)
        config = ClusterConfig(scheduler=limits, num_replicas=1 + spares, autoscaling=autoscaling, replica_start_s=60.0,
                               record_token_times=False, seed=args.seed)
        run = SimCluster(config, step_model).run(workload)
        summary = summarize(run.results)
        bins = ttft_p90_bins(run.results, 5.0)
        out[f"spares_{spares}"] = {"recovery_s": recovery_s(run.results, phases[0][0], 1.0), **figures(summary),
                                   "max_replicas": max(d["ready"] for d in run.decisions),
                                   # For the plot: replicas ready every 5 s, TTFT p90 per 5-s bin of arrivals.
                                   "ready": [(d["t_s"], d["ready"]) for d in run.decisions[::5]],
                                   "ttft_p90_bins": bins}
        log(f"warm_spares {spares}: " + str({k: v for k, v in out[f"spares_{spares}"].items()
                                             if k not in ("ready", "ttft_p90_bins")}))
    return out


PARTS = ("validation", "scale", "routing", "warm_spares")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = load_step_model(args.gpu_profile)
    started_s = time.perf_counter()
    result: dict[str, Any] = {"quick": args.quick, "parts": list(args.parts)}
    if "validation" in args.parts:
        result["validation"] = validation(args, validation_profile(args))
        result["validation_max_rel_error"] = result["validation"]["max_rel_error"]
    if "scale" in args.parts:
        result["scale"] = scale(args, gpu)
        result.update(scale_replicas=args.scale_replicas, scale_requests=args.scale_requests,
                      scale_wall_s=result["scale"]["wall_s"], scale_workers=args.scale_workers,
                      scale_wall_ms_per_request=result["scale"]["wall_ms_per_request"])
    if "routing" in args.parts:
        result["routing"] = routing(args, gpu)
    if "warm_spares" in args.parts:
        result["warm_spares"] = warm_spares(args, gpu)
    result["wall_s"] = time.perf_counter() - started_s
    (args.out / "sim_bench.json").write_text(json.dumps(finite(result), indent=1))
    from simulator.validation.plots import write_plots

    write_plots(result, args.out)
    print(json.dumps(finite(result)), flush=True)
    return result


if __name__ == "__main__":
    main()
