"""The simulator against the real *served* system: the same workloads over HTTP (one local Ray Serve,
the tiny model, every step padded) and through SimCluster, at 1 and 3 replicas.

    python -m simulator.validation.served [--quick] [--out bench_results/sim_served]

Cases, each on a freshly deployed application (`deployments.app.build_app`), then simulated with
the scheduler limits read from that deployment (EngineConfig built from its engine_args as the
replica builds it; max_model_len from the replica's model_info), its router policy and
routing-stats period, its per-replica admission and, for the autoscaling case, its
AutoscalerConfig, decided every METRICS_INTERVAL_S (how often replicas push their load to Serve's
controller: the decision cannot change faster than its inputs):
  trace_x1, trace_x3       Azure-trace requests (prompts / 4, outputs / 2), 1 and 3 replicas;
  multi_turn_x1            shared-prefix multi-turn conversations (bench_routing's), 1 replica;
  multi_turn_x3_<policy>   the same on 3 replicas, for prefix_aware, pow2 and round_robin;
  autoscale                a 1x -> 4x -> 1x step load (bench_autoscaling's, max_replicas 3), the
                           sim's replica_start_s being the cold start measured in the real run
                           (ReplicaWatch: Serve's STARTING -> RUNNING, median).

The step model is PaddedStepModel: max(pad, tiny-cpu profile), as PaddedRunner pads execute().
The served path costs two things the profile does not hold, calibrated ONCE on a separate run
(1 replica, Azure trace, seed + 1, on the same deployment as trace_x1, which it also warms up) and
then held fixed for every compared case:
  step_overhead_s   = real TPOT p50 - simulated TPOT p50 with no overheads (the engine loop's
                      host work between forwards: scheduling, pushing outputs to the replica);
  request_latency_s = real TTFT p50 - simulated TTFT p50 with that step overhead (HTTP proxy,
                      ingress, handle, the engine process's queue, streaming back).
Both are clamped at 0. No compared run tunes anything.

Diagnostics beside the compared figures: every case's inter-token latency p99, real and simulated
(a real step that outgrew the pad, from host contention, shows there first), and with
--real-repeats N the 3-replica multi-turn cases' real runs repeated N times on fresh deployments,
the range of their real figures (`real_spread`) and whether the simulated figure lies inside it:
what the real system itself moves by from run to run. The first of them is the compared run.
--parts runs a subset (the calibration always runs).

Ranking (3-replica multi-turn): policies ordered by TTFT p50 (lower first) and by prefix-cache hit
rate (higher first; the real one from /metrics counters). `ranking_match` is true when, for every
pair of policies the real run separates (TTFT p50 more than TIE_TTFT_REL apart, hit rates more
than TIE_HIT_RATE apart), the simulation orders them the same way; pairs the real run does not
separate (pow2 and round_robin both route by load alone) may come in either order. Both strict
rankings are reported too.

Prints real vs sim per case and the relative errors to stderr; the last stdout line is one JSON
object (per case figures, max_rel_error, ranking_match, the calibrated scalars), also written to
OUT/served_validation.json. Every request's TTFT per case, real and simulated, and the autoscaling
case's replica timelines go to OUT/served_samples.json, drawn as OUT/served_validation.png
(`python -m simulator.validation.plots --served OUT/served_samples.json PNG` redraws it). Ray and torch
are imported inside the functions that need them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autoscaler.policy import AutoscalerConfig
from loadtest import workloads as wl
from loadtest.results import RequestResult, finite, summarize
from simulator.validation.bench import figures, rel_errors, trace_workload
from simulator.cli import load_step_model
from simulator.cluster import ClusterConfig, SimCluster, SimRun
from loadtest.traces import BenchRequest
from model_worker.config import EngineConfig, SchedulerConfig
from router.policy import RouterConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("prefix_aware", "pow2", "round_robin")
PARTS = ("trace", "multi_turn", "autoscale")
# Pairs of policies the real run does not separate by more than this may rank either way.
TIE_TTFT_REL = 0.05
TIE_HIT_RATE = 0.02
APP = "iterserve"


class PaddedStepModel:
    """A step-time model under PaddedRunner: a non-empty step lasts at least pad_s."""

    def __init__(self, model: Any, pad_s: float) -> None:
        if not (pad_s >= 0 and math.isfinite(pad_s)):
            raise ValueError(f"pad_s must be a finite number >= 0, got {pad_s!r}")
        self.model, self.pad_s = model, pad_s
        self.idle_wake_s = getattr(model, "idle_wake_s", 0.0)

    def predict(self, batch: Any) -> float:
        if not batch.sequences:
            return 0.0
        return max(self.pad_s, self.model.predict(batch))


# ---- pure parts: errors, rankings, calibration, configs -------------------------------------

def max_rel_error(cases: dict[str, dict[str, Any]]) -> float | None:
    """The largest relative error of any figure of any case (None where none was computed)."""
    errors = [e for case in cases.values() for e in case["rel_error"].values() if e is not None]
    return max(errors) if errors else None


def ranking(values: dict[str, float], higher_is_better: bool) -> list[str]:
    return sorted(values, key=lambda k: (-values[k] if higher_is_better else values[k], k))


def rankings_agree(real: dict[str, float], sim: dict[str, float], higher_is_better: bool, tie_rel: float = 0.0,
                   tie_abs: float = 0.0) -> bool:
    """True when every pair the real values separate (by more than max(tie_abs, tie_rel * the
    larger)) is ordered the same way, strictly, by the simulated values."""
    sign = 1.0 if higher_is_better else -1.0
    for a in real:
        for b in real:
            gap = real[a] - real[b]
            if sign * gap > max(tie_abs, tie_rel * max(abs(real[a]), abs(real[b]))) and not sign * (sim[a] - sim[b]) > 0:
                return False
    return True


def overhead_gap(real_s: float | None, sim_s: float | None) -> float:
    """A calibrated cost: what the real figure has beyond the simulated one, never below 0."""
    if real_s is None or sim_s is None:
        raise ValueError("calibration needs both a real and a simulated figure")
    return max(real_s - sim_s, 0.0)


def router_config(router_args: dict[str, Any]) -> tuple[RouterConfig, float]:
    """The `router` app arg as the sim takes it: a RouterConfig and the dispatch TTL."""
    fields = {k: v for k, v in router_args.items() if k not in ("dispatch_ttl_s", "seed")}
    return RouterConfig(**fields), float(router_args.get("dispatch_ttl_s", 10.0))


def cluster_config(app_args: dict[str, Any], max_model_len: int, **extra: Any) -> ClusterConfig:
    """A ClusterConfig with the deployment's scheduler limits (EngineConfig from its engine_args,
    as LLMServer builds it), router, routing-stats period and per-replica admission."""
    engine = EngineConfig(**{"model": app_args.get("model"), **app_args.get("engine_args", {})})
    if engine.num_kv_blocks is None:
        raise ValueError("the validation needs a fixed num_kv_blocks (a cache sized from memory is not known here)")
    router, ttl_s = router_config(app_args.get("router", {"policy": "prefix_aware"}))
    limits = SchedulerConfig(block_size=engine.block_size, num_kv_blocks=engine.num_kv_blocks,
                             max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                             max_model_len=min(engine.max_model_len or max_model_len, max_model_len),
                             enable_prefix_caching=engine.enable_prefix_caching, batching=engine.batching,
                             max_decode_slowdown=engine.max_decode_slowdown)
    return ClusterConfig(scheduler=limits, num_replicas=app_args.get("num_replicas") or 1, router=router, dispatch_ttl_s=ttl_s,
                         routing_stats_period_s=app_args.get("routing_stats_period_s", 1.0),
                         admission=dict(app_args.get("admission", {})), **extra)


def autoscaler_config(autoscaling_args: dict[str, Any]) -> AutoscalerConfig:
    return AutoscalerConfig(**{k: v for k, v in autoscaling_args.items() if k != "initial_replicas"})


def compare(real: dict[str, float | None], sim: dict[str, float | None], **extra: Any) -> dict[str, Any]:
    return {"real": real, "sim": sim, "rel_error": rel_errors(real, sim), **extra}


def itl_p99(results: list[RequestResult]) -> float | None:
    """The p99 of every inter-token gap of every answered request."""
    gaps = [gap for r in results if r.ok for gap in r.itls_s]
    return float(np.quantile(gaps, 0.99)) if gaps else None


def ranges(runs: list[dict[str, float | None]]) -> dict[str, list[float] | None]:
    """Each figure's [min, max] over runs (None where no run has it)."""
    spread: dict[str, list[float] | None] = {}
    for key in runs[0]:
        values = [run[key] for run in runs if run.get(key) is not None]
        spread[key] = [min(values), max(values)] if values else None
    return spread


def inside(observed: dict[str, float | None], spread: dict[str, list[float] | None]) -> dict[str, bool]:
    """Per figure of the spread, whether the observed one lies within it."""
    return {key: observed.get(key) is not None and bounds[0] <= observed[key] <= bounds[1]
            for key, bounds in spread.items() if bounds is not None}


def real_spread(runs: list[dict[str, float | None]], sim: dict[str, float | None]) -> dict[str, Any]:
    """The range of each figure over repeated real runs, and whether the simulated one lies inside."""
    spread = ranges(runs)
    return {"runs": len(runs), "range": spread, "sim_within": inside(sim, spread)}


# ---- the real side ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer requests: 10 min here, against 23 min for the full run; its TTFT p99 of 72 "
                        "multi-turn requests and p50 of a 60-s step are small samples (docs/simulator.md)")
    # 100 ms, with 256-token chunks: the pad stays well above the tiny model's real forward (a
    # decode at one thread, or a prompt chunk of max_num_batched_tokens), so 3 replicas on 2 cores
    # are paced by the pad, not by the CPU they share. Replicas that are CPU-bound slow one another,
    # which no simulation of independent replicas can follow.
    p.add_argument("--pad", type=float, default=0.1, help="emulated_step_time_s, seconds")
    p.add_argument("--chunk-tokens", type=int, default=256, help="max_num_batched_tokens of every replica")
    p.add_argument("--trace-rate", type=float, default=0.8, help="Azure-trace req/s per replica")
    p.add_argument("--profile", default="tiny-cpu", help="step-time profile under the pad")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default="trace,multi_turn,autoscale",
                   help="comma-separated subset of trace, multi_turn, autoscale (the calibration always runs)")
    p.add_argument("--real-repeats", type=int, default=1,
                   help="real runs of each 3-replica multi-turn case, each on a fresh deployment (>= 1)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "sim_served")
    args = p.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"--parts takes a subset of {', '.join(PARTS)}; got {unknown or 'nothing'}")
    if args.real_repeats < 1:
        p.error(f"--real-repeats must be >= 1, got {args.real_repeats}")
    q = args.quick
    args.trace_requests = 45 if q else 150  # per replica
    args.calibration_requests = 40 if q else 100
    args.conversations, args.turns = (12, 6) if q else (32, 8)
    args.step_phases_s = (10.0, 30.0, 20.0) if q else (20.0, 60.0, 40.0)
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def app_args(args: argparse.Namespace, num_kv_blocks: int, policy: str = "prefix_aware", replicas: int | None = 1,
             **extra: Any) -> dict[str, Any]:
    engine_args = {"num_threads": 1, "num_kv_blocks": num_kv_blocks, "emulated_step_time_s": args.pad,
                   "max_num_batched_tokens": args.chunk_tokens, **extra.pop("engine_args", {})}
    out = {"model": "tiny", "engine_args": engine_args, "router": {"policy": policy}, "routing_stats_period_s": 0.5,
           "admission": {"max_waiting_requests": 100_000}, **extra}
    if replicas is not None:
        out["num_replicas"] = replicas
    return out


def deploy(args_dict: dict[str, Any]) -> int:
    """A fresh application; returns the replicas' max_model_len (their model_info)."""
    from ray import serve

    from deployments.app import LLM_SERVER, build_app

    serve.delete(APP)
    serve.run(build_app(args_dict), name=APP, route_prefix="/")
    handle = serve.get_deployment_handle(LLM_SERVER, app_name=APP)
    return int(handle.model_info.remote().result().max_model_len)


def ttfts(results: list[RequestResult]) -> list[float]:
    """Every answered request's TTFT, sorted (a CDF's x values)."""
    return sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)


def real_run(base: str, label: str, workload: list[BenchRequest]
             ) -> tuple[dict[str, float | None], float, list[RequestResult]]:
    """Figures of the workload over HTTP, the prefix-cache hit rate (/metrics counters) and the
    requests' results."""
    from loadtest.bench_cli import measure
    from loadtest.benchmarks.bench_routing import prefix_counters
    from loadtest.client import ClientConfig
    from loadtest.results import SLO

    _, hits0, queries0 = prefix_counters(base)
    started_s = time.monotonic()
    run = measure(workload, ClientConfig(base, max_duration_s=900, sample_interval_s=0), label, label, None, SLO())
    _, hits1, queries1 = prefix_counters(base)
    summary = run["summary"]
    log(f"  real {label}: {len(workload)} requests, {summary['num_ok']} ok, {time.monotonic() - started_s:.0f} s")
    results = [RequestResult.from_dict(r) for r in run["results"]]
    return figures(summary), (hits1 - hits0) / max(queries1 - queries0, 1.0), results


def simulate(config: ClusterConfig, step_model: Any, workload: list[BenchRequest]) -> tuple[SimRun, dict[str, Any]]:
    run = SimCluster(config, step_model).run(workload)
    return run, figures(summarize(run.results))


# Seeds of the simulated router's random draws over which a random policy's figures are spread.
SPREAD_SEEDS = 20


def seed_spread(config_for: Any, step_model: Any, workload: list[BenchRequest], real: dict[str, float | None],
                real_hits: float, seeds: int = SPREAD_SEEDS) -> dict[str, Any]:
    """A random policy's simulated figures over `seeds` random streams (config_for(seed) gives
    each run's config): the real run drew one stream of its own, so its figures are one sample of
    that spread, and `within` says, per figure, whether the real one lies inside it."""
    runs = [simulate(config_for(seed), step_model, workload) for seed in range(seeds)]
    spread = ranges([{**sim, "hit_rate": hit_rate(run)} for run, sim in runs])
    return {"seeds": seeds, "range": spread, "within": inside({**real, "hit_rate": real_hits}, spread)}


def hit_rate(run: SimRun) -> float:
    return run.counters["cached_tokens"] / max(run.counters["prompt_tokens"], 1.0)


def log_case(name: str, case: dict[str, Any]) -> None:
    def fmt(v: float | None, key: str) -> str:
        return "-" if v is None else (f"{v:8.1f}" if key == "output_tokens_per_s" else f"{v * 1e3:7.1f}ms")

    log(f"{name}:")
    for key in case["real"]:
        err = case["rel_error"][key]
        log(f"  {key:<20} real {fmt(case['real'][key], key)}  sim {fmt(case['sim'][key], key)}  "
            f"error {'-' if err is None else f'{err:6.1%}'}{'  > 15%' if err is not None and err > 0.15 else ''}")
    extras = {k: v for k, v in case.items() if k not in ("real", "sim", "rel_error")}
    if extras:
        log(f"  {extras}")


# ---- the cases --------------------------------------------------------------------------------

def calibrate_and_trace(args: argparse.Namespace, base: str, pool: np.ndarray, step_model: PaddedStepModel,
                        cases: dict[str, Any], samples: dict[str, Any]) -> dict[str, float]:
    """The calibration run, then trace_x1, on one deployment (calibration first: it warms up)."""
    spec = app_args(args, 1024, replicas=1)
    max_len = deploy(spec)
    calibration = trace_workload(args.calibration_requests, args.trace_rate, pool, args.seed + 1)
    real, _, _ = real_run(base, "calibration", calibration)
    _, bare = simulate(cluster_config(spec, max_len, seed=args.seed), step_model, calibration)
    step_overhead_s = overhead_gap(real["tpot_p50_s"], bare["tpot_p50_s"])
    _, stepped = simulate(cluster_config(spec, max_len, step_overhead_s=step_overhead_s, seed=args.seed), step_model,
                          calibration)
    request_latency_s = overhead_gap(real["ttft_p50_s"], stepped["ttft_p50_s"])
    calibrated = {"step_overhead_s": step_overhead_s, "request_latency_s": request_latency_s}
    log(f"calibration: real {real}; sim without overheads {bare}; calibrated {calibrated}")
    for replicas in (1, 3) if "trace" in args.parts else ():
        if replicas == 3:
            spec = app_args(args, 1024, replicas=3)
            max_len = deploy(spec)
        workload = trace_workload(args.trace_requests * replicas, args.trace_rate * replicas, pool, args.seed)
        real, _, real_results = real_run(base, f"trace x{replicas}", workload)
        run, sim = simulate(cluster_config(spec, max_len, seed=args.seed, **calibrated), step_model, workload)
        cases[f"trace_x{replicas}"] = compare(real, sim, requests=len(workload), itl_p99_s_real=itl_p99(real_results),
                                              itl_p99_s_sim=itl_p99(run.results))
        samples[f"trace_x{replicas}"] = {"real": ttfts(real_results), "sim": ttfts(run.results)}
        log_case(f"trace_x{replicas}", cases[f"trace_x{replicas}"])
    return calibrated


def multi_turn_workload(args: argparse.Namespace, pool: np.ndarray) -> list[BenchRequest]:
    """bench_routing's conversations: 1024-token system prompts shared by 8 apps, 64-token user
    turns, 32-token answers, 0.5 new conversations a second, 0.2 s think time."""
    starts = wl.arrivals(args.conversations, 0.5, "poisson", args.seed)
    return wl.multi_turn(args.conversations, args.turns, 1024, 64, 32, starts, pool, args.seed, think_time_s=0.2,
                         num_system_prompts=8)


def multi_turn(args: argparse.Namespace, base: str, pool: np.ndarray, step_model: PaddedStepModel,
               calibrated: dict[str, float], cases: dict[str, Any], samples: dict[str, Any]) -> dict[str, Any]:
    """320 KV blocks a replica (bench_routing's): 5 of the 8 system prompts, so routing matters."""
    workload = multi_turn_workload(args, pool)
    runs = [(1, "prefix_aware")] + [(3, policy) for policy in POLICIES]
    for replicas, policy in runs:
        name = f"multi_turn_x{replicas}" + (f"_{policy}" if replicas > 1 else "")
        spec = app_args(args, 320, policy, replicas)
        max_len = deploy(spec)
        real, real_hits, real_results = real_run(base, name, workload)
        run, sim = simulate(cluster_config(spec, max_len, seed=args.seed, **calibrated), step_model, workload)
        real_itl, sim_itl, sim_hits = itl_p99(real_results), itl_p99(run.results), hit_rate(run)
        cases[name] = compare(real, sim, requests=len(workload), policy=policy, hit_rate_real=real_hits,
                              hit_rate_sim=sim_hits, itl_p99_s_real=real_itl, itl_p99_s_sim=sim_itl)
        if replicas > 1 and args.real_repeats > 1:
            repeats = [{**real, "hit_rate": real_hits, "itl_p99_s": real_itl}]
            for _ in range(args.real_repeats - 1):
                deploy(spec)
                again, again_hits, again_results = real_run(base, name, workload)
                repeats.append({**again, "hit_rate": again_hits, "itl_p99_s": itl_p99(again_results)})
            cases[name]["real_spread"] = real_spread(repeats, {**sim, "hit_rate": sim_hits, "itl_p99_s": sim_itl})
        samples[name] = {"real": ttfts(real_results), "sim": ttfts(run.results)}
        if policy == "pow2":  # a random policy: one simulated stream against the real one is one sample
            cases[name]["seed_spread"] = seed_spread(
                lambda seed, spec=spec, max_len=max_len: cluster_config(spec, max_len, seed=seed, **calibrated),
                step_model, workload, real, real_hits)
        log_case(name, cases[name])
    three = {p: cases[f"multi_turn_x3_{p}"] for p in POLICIES}
    ttft = {side: {p: c[side]["ttft_p50_s"] for p, c in three.items()} for side in ("real", "sim")}
    hits = {side: {p: c[f"hit_rate_{side}"] for p, c in three.items()} for side in ("real", "sim")}
    out = {"by_ttft_p50": {side: ranking(v, False) for side, v in ttft.items()},
           "by_hit_rate": {side: ranking(v, True) for side, v in hits.items()},
           "ttft_match": rankings_agree(ttft["real"], ttft["sim"], False, tie_rel=TIE_TTFT_REL),
           "hit_rate_match": rankings_agree(hits["real"], hits["sim"], True, tie_abs=TIE_HIT_RATE)}
    out["strict_match"] = (out["by_ttft_p50"]["real"] == out["by_ttft_p50"]["sim"]
                           and out["by_hit_rate"]["real"] == out["by_hit_rate"]["sim"])
    log(f"ranking (3 replicas): {out}")
    return out


def autoscale(args: argparse.Namespace, base: str, pool: np.ndarray, step_model: PaddedStepModel,
              calibrated: dict[str, float], cases: dict[str, Any], samples: dict[str, Any]) -> None:
    """bench_autoscaling's step load with max_replicas 3: 4 seats a replica, 64-token prompts,
    16-token answers; C = 60% of one replica's seat throughput, 1x -> 4x -> 1x of C."""
    from autoscaler.serve_policy import METRICS_INTERVAL_S
    from loadtest.benchmarks.bench_autoscaling import ReplicaWatch, cold_starts_s

    seats, prompt, output = 4, 64, 16
    c = 0.6 * seats / ((output + 1) * args.pad)
    low, high, tail = args.step_phases_s
    times = wl.step_arrivals([(low, c), (high, 4 * c), (tail, c)], args.seed)
    fixed = lambda n: wl.LengthDist("fixed", n, n, n)  # noqa: E731
    workload = wl.synthetic(len(times), fixed(prompt), fixed(output), times, pool, args.seed)
    scaling = {"min_replicas": 1, "max_replicas": 3, "warm_spares": 0, "target_queue_per_replica": seats / 2,
               "ttft_slo_s": 1.0, "scale_up_delay_s": 2.0, "scale_down_delay_s": 15.0 if args.quick else 20.0}
    spec = app_args(args, 128, replicas=None, autoscaling=scaling, drain_timeout_s=30,
                    engine_args={"max_num_seqs": seats})
    max_len = deploy(spec)
    watch = ReplicaWatch(time.monotonic())
    watch.wait_for(1)
    watch.t0 = time.monotonic()
    watch.samples.clear()
    real, _, real_results = real_run(base, "autoscale", workload)
    watched = watch.stop()
    colds = cold_starts_s(watched)
    # Replicas running at most, and asked for at most (running + starting in Serve; the target in the sim).
    real_max = max((s[1] for s in watched), default=0)
    real_asked = max((s[2] for s in watched), default=0)
    if not colds:
        raise RuntimeError("the real run started no replica: no cold start to give the simulator")
    start_s = statistics.median(colds)
    config = cluster_config(spec, max_len, autoscaling=autoscaler_config(scaling), autoscale_period_s=METRICS_INTERVAL_S,
                            replica_start_s=start_s, seed=args.seed, **calibrated)
    run, sim = simulate(config, step_model, workload)
    sim_max = max(d["ready"] for d in run.decisions)
    sim_asked = max(d["target"] for d in run.decisions)
    cases["autoscale"] = compare(real, sim, requests=len(workload), itl_p99_s_real=itl_p99(real_results),
                                 itl_p99_s_sim=itl_p99(run.results), capacity_req_s=c, cold_starts_s=colds,
                                 replica_start_s=start_s, max_replicas_real=real_max, max_replicas_sim=sim_max,
                                 max_replicas_match=real_max == sim_max, max_asked_real=real_asked,
                                 max_asked_sim=sim_asked)
    log_case("autoscale", cases["autoscale"])
    # Timelines from the load's start: (t, running, asked for) real, (t, ready, target) simulated.
    samples["autoscale"] = {"real": ttfts(real_results), "sim": ttfts(run.results),
                            "replicas_real": [list(s) for s in watched],
                            "replicas_sim": [[d["t_s"], d["ready"], d["target"]] for d in run.decisions]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from loadtest.bench_cli import token_pool
    from loadtest.local_serve import start_local_serve, stop_local_serve

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started_s = time.monotonic()
    step_model = PaddedStepModel(load_step_model(args.profile), args.pad)
    pool = token_pool("tiny")
    cases: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    base = start_local_serve()
    try:
        calibrated = calibrate_and_trace(args, base, pool, step_model, cases, samples)
        rankings = None
        if "multi_turn" in args.parts:
            rankings = multi_turn(args, base, pool, step_model, calibrated, cases, samples)
        if "autoscale" in args.parts:
            autoscale(args, base, pool, step_model, calibrated, cases, samples)
    finally:
        stop_local_serve()
    result = {"quick": args.quick, "pad_s": args.pad, "profile": args.profile, "calibrated": calibrated,
              "cases": cases, "max_rel_error": max_rel_error(cases),
              "parts": args.parts, "real_repeats": args.real_repeats,
              "ranking_match": rankings["ttft_match"] and rankings["hit_rate_match"] if rankings else None,
              "rankings": rankings,
              "cases_over_15pct": sorted(n for n, c in cases.items()
                                         if any(e is not None and e > 0.15 for e in c["rel_error"].values())),
              "wall_s": time.monotonic() - started_s}
    (args.out / "served_validation.json").write_text(json.dumps(finite(result), indent=1))
    (args.out / "served_samples.json").write_text(json.dumps(finite({"quick": args.quick, "cases": samples})))
    from simulator.validation.plots import plot_served_validation

    plot_served_validation(samples, args.out / "served_validation.png")
    log(f"wall time {result['wall_s']:.0f} s; max relative error {result['max_rel_error']}")
    print(json.dumps(finite(result)), flush=True)
    return result


if __name__ == "__main__":
    main()
