"""Request-level (static) against continuous batching, on one Serve instance, over HTTP.

    python -m loadtest.benchmarks.bench_batching [--quick] [--out bench_results/batching]

Starts a local Ray and two copies of the iterserve application on the tiny model (`--model` for another), one with
`batching: continuous` (at /continuous) and one with `batching: static` (at /static); only the
one being measured has work at any moment. Then:

1. The short-beside-long example: a request for 8 tokens and one for 64 arrive together. Under
   continuous batching the short one returns after its own 8 steps; under static batching its
   response ends only with the long one's batch.
2. A rate sweep over the Azure conversation trace (lengths scaled to the tiny model, arrivals
   re-timed to each rate), alternating the two modes at each rate, until each mode's p99 TTFT
   passes the SLO: the highest rate under the SLO is what each mode sustains.

The last line printed is one JSON object with the headline figures. Everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import workloads as wl
from loadtest.bench_cli import measure, summary_line, token_pool, write_outputs
from loadtest.client import ClientConfig
from loadtest.local_serve import start_local_serve, stop_local_serve
from loadtest.report import max_rate_under_slo, write_report
from loadtest.results import SLO
from loadtest.traces import BenchRequest, LengthScaler, default_trace_path, load_azure_trace

MODES = ("continuous", "static")
REPO_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests and rates (under 5 minutes)")
    p.add_argument("--rates", default=None,
                   help="comma list of req/s, ascending (default 1,1.5,2,3,4,6,8,10,12,16; quick 1,2,3,4,6,8,12)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per sweep point (default 40; quick 10): long enough that a rate "
                        "above capacity shows as a growing queue, not a burst that drains")
    p.add_argument("--min-requests", type=int, default=None, help="per sweep point (default 30; quick 20)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="p99 TTFT bound in seconds for the sweep")
    p.add_argument("--repeats", type=int, default=None, help="short-beside-long repeats (default 5; quick 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each replica")
    p.add_argument("--model", default="tiny",
                   help="the model every replica serves (default: the tiny random model, so that replicas, "
                        "not this machine's cores, set the pace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "batching")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in (args.rates or ("1,2,3,4,6,8,12" if args.quick else "1,1.5,2,3,4,6,8,10,12,16")).split(",")]
    args.duration = args.duration or (10.0 if args.quick else 40.0)
    args.min_requests = args.min_requests or (20 if args.quick else 30)
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


def start_servers(threads: int, model: str | None) -> str:
    """Local Ray, one HTTP proxy on a free loopback port, one application per batching mode."""
    from ray import serve

    from deployments.app import build_app

    base = start_local_serve()
    for mode in MODES:
        # The waiting limit is lifted: shedding would hide the queueing this benchmark measures.
        args = {"model": model, "engine_args": {"batching": mode, "num_threads": threads},
                "admission": {"max_waiting_requests": 100_000}}
        serve.run(build_app(args), name=f"iterserve-{mode}", route_prefix=f"/{mode}")
    return base


def short_beside_long(base: str, pool: np.ndarray, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    """Median end-to-end latency of the 8-token and the 64-token request, per mode."""
    rng = np.random.default_rng(seed)
    latencies: dict[str, dict[str, list[float]]] = {m: {"short": [], "long": []} for m in MODES}
    for i in range(repeats):
        prompt = tuple(int(t) for t in rng.choice(pool, size=16))
        # The long one first: were the short one alone in a static batch, it would never wait.
        pair = [BenchRequest(f"long-{i}", prompt[::-1], 64, 0.0), BenchRequest(f"short-{i}", prompt, 8, 0.02)]
        for mode in MODES:
            run = measure(pair, ClientConfig(f"{base}/{mode}", sample_interval_s=0), f"{mode} pair", mode, None, SLO())
            for result in run["results"]:
                assert result["status"] == 200 and result["error"] is None, result
                kind = result["request_id"].split("-")[0]
                latencies[mode][kind].append(result["finish_s"] - result["sent_s"])
    return {m: {k: statistics.median(v) for k, v in by_kind.items()} for m, by_kind in latencies.items()}


def sweep(base: str, args: argparse.Namespace, pool: np.ndarray) -> list[dict[str, Any]]:
    """Alternate modes at each rate; a mode stops once its p99 TTFT passed the SLO."""
    rows = load_azure_trace(default_trace_path())
    slo = SLO(ttft_s=args.slo_ttft)
    runs: list[dict[str, Any]] = []
    active = list(MODES)
    for i, rate in enumerate(args.rates):
        # The trace's first rows, as many as arrive in `duration` at this rate; fresh prompt tokens
        # per rate so no run hits the prefix cache of an earlier one.
        num_requests = max(args.min_requests, round(rate * args.duration))
        workload = wl.trace_replay(rows, num_requests, pool, args.seed + 1 + i,
                                   speedup=rate / wl.trace_rate(rows, num_requests), scaler=LengthScaler())
        for mode in list(active):
            config = ClientConfig(f"{base}/{mode}", max_duration_s=600.0)
            run = measure(workload, config, f"{mode} @ {rate:g} req/s", mode, rate, slo)
            runs.append(run)
            print(summary_line(run), flush=True)
            p99 = run["summary"]["ttft_s"]["p99"]
            if p99 is None or p99 > args.slo_ttft:
                active.remove(mode)
        if not active:
            break
    return runs


def warm_up(base: str, pool: np.ndarray) -> None:
    rng = np.random.default_rng(12345)
    for mode in MODES:
        workload = [BenchRequest(f"warm-{i}", tuple(int(t) for t in rng.choice(pool, size=64)), 16, 0.0)
                    for i in range(8)]
        measure(workload, ClientConfig(f"{base}/{mode}", sample_interval_s=0), f"warm-up {mode}", mode, None, SLO())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    pool = token_pool(args.model)
    base = start_servers(args.threads, args.model)
    try:
        print(f"servers up in {time.monotonic() - started_s:.0f}s at {base}/{{{','.join(MODES)}}}", flush=True)
        warm_up(base, pool)
        pair = short_beside_long(base, pool, args.repeats, args.seed)
        for mode in MODES:
            print(f"short beside long, {mode}: short {pair[mode]['short']:.3f}s, long {pair[mode]['long']:.3f}s",
                  flush=True)
        runs = sweep(base, args, pool)
    finally:
        stop_local_serve()
    headline = {
        "short_latency_continuous_s": pair["continuous"]["short"], "short_latency_static_s": pair["static"]["short"],
        "long_latency_continuous_s": pair["continuous"]["long"], "long_latency_static_s": pair["static"]["long"],
        "max_rate_continuous": max_rate_under_slo(runs, "continuous", args.slo_ttft),
        "max_rate_static": max_rate_under_slo(runs, "static", args.slo_ttft),
        "slo_ttft_p99_s": args.slo_ttft,
    }
    if headline["max_rate_continuous"] and headline["max_rate_static"]:
        headline["max_rate_ratio"] = headline["max_rate_continuous"] / headline["max_rate_static"]
    # A mode still under the SLO at the sweep's top rate may sustain more: its figure is a floor.
    headline["lower_bound"] = [m for m in MODES if headline[f"max_rate_{m}"] == args.rates[-1]]
    write_outputs(args.out, runs)
    notes = [f"command: python -m loadtest.benchmarks.bench_batching {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"short beside long (median of {args.repeats}): continuous short {headline['short_latency_continuous_s']:.3f}s "
             f"/ long {headline['long_latency_continuous_s']:.3f}s; static short {headline['short_latency_static_s']:.3f}s "
             f"/ long {headline['long_latency_static_s']:.3f}s",
             f"sweep: Azure conversation trace, {args.duration:g} s of arrivals per point (at least "
             f"{args.min_requests} requests), lengths scaled (prompt/4 <= 512, output/2 <= 256), arrivals re-timed "
             f"to each rate; {os.cpu_count()} CPU cores, {args.threads} torch threads per replica",
             f"total wall time {time.monotonic() - started_s:.0f}s"]
    write_report(args.out, "Continuous against static batching", runs, notes=notes, slo_ttft_s=args.slo_ttft)
    print(json.dumps(headline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
