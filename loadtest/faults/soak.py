"""A soak: minutes of steady load at 80% of measured capacity, with every process's memory tracked.

    python -m loadtest.faults.soak [--minutes 10] [--load 0.8] [--replicas 2] [--out bench_results/soak]

The script deploys the iterserve application (the tiny model by default, `--model`; `--replicas` LLMServer replicas) on
a local Ray, measures capacity (completed requests per second with 64 requests always in flight,
for 60 s), then sends Poisson arrivals at `--load` x capacity for `--minutes`. Every 10 s it reads
the resident memory (VmRSS) of each LLMServer replica, the ingress, the HTTP proxy and the Serve
controller. A leak shows as growth after the first minute (allocator warm-up and caches fill in
it). The last line is one JSON object: capacity_rps, offered_rps, requests, ok, errors, latency
p50/p99 per minute, and per process rss_mb at minute 1 and at the end, growth_mb_per_hour (a
least-squares slope over the samples after minute 1) and growth_mb_second_half (a leak keeps
growing; a high-water mark set by a busy minute does not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.faults import harness
from loadtest.faults.bench_chaos import request_pool
from loadtest.local_serve import start_local_serve, stop_local_serve

APP = "iterserve"
REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_EVERY_S = 10.0
# Process titles Ray gives the Serve processes that are not LLMServer replicas.
_OTHER_PROCESSES = {"ingress": "ServeReplica:iterserve:OpenAIIngress", "proxy": "ProxyActor",
                    "controller": "ServeController"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--load", type=float, default=0.8, help="share of measured capacity to offer")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--capacity-s", type=float, default=60.0, help="seconds of the capacity measurement")
    p.add_argument("--model", default="tiny",
                   help="the model every replica serves (default: the tiny random model, so that replicas, "
                        "not this machine's cores, set the pace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "soak")
    return p.parse_args(argv)


def deploy(replicas: int, model: str | None) -> None:
    from ray import serve

    from deployments.app import build_app

    app_args = {"model": model, "num_replicas": replicas, "engine_args": {"num_threads": 1, "max_num_seqs": 64},
                "admission": {"max_waiting_requests": 100_000}}
    serve.run(build_app(app_args), name=APP, route_prefix="/")


def processes(app: str) -> dict[str, int]:
    """name -> pid of every process whose memory is tracked."""
    found = {f"replica {r.replica_id}": r.pid for r in harness.live_replicas(app)}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name, marker in _OTHER_PROCESSES.items():
            if title.startswith("ray::") and marker in title:
                found[name] = int(pid)
    return found


async def capacity(base: str, pool: list[dict[str, Any]], seconds: float, concurrency: int = 64) -> float:
    """Requests per second completed with `concurrency` always in flight."""
    stop_s = time.monotonic() + seconds
    done = 0
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async def worker(offset: int) -> None:
            nonlocal done
            k = offset
            while time.monotonic() < stop_s:
                outcome = await harness.stream_completion(client, _greedy(pool[k % len(pool)]), 300)
                done += outcome.status == 200 and outcome.error is None
                k += concurrency
        started_s = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done / (time.monotonic() - started_s)


def _greedy(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "temperature": 0}


async def soak(base: str, pool: list[dict[str, Any]], rate: float, minutes: float, seed: int,
               tracked: dict[str, int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    duration_s = minutes * 60
    started_s = time.monotonic()

    async def sampler() -> None:
        while time.monotonic() - started_s < duration_s:
            samples.append({"t_s": round(time.monotonic() - started_s, 1),
                            **{name: harness.rss_bytes(pid) for name, pid in tracked.items()}})
            await asyncio.sleep(SAMPLE_EVERY_S)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        async def one(k: int, sent_s: float) -> None:
            outcome = await harness.stream_completion(client, _greedy(pool[k]), 300)
            records.append({"sent_s": sent_s, "ok": outcome.status == 200 and outcome.error is None
                            and not outcome.hung, "elapsed_s": outcome.elapsed_s,
                            "error": (outcome.error or {}).get("code") or outcome.transport_error})

        sampling = asyncio.ensure_future(sampler())
        tasks, t_s = [], 0.0
        while True:
            t_s += rng.exponential(1 / rate)
            if t_s > duration_s:
                break
            await asyncio.sleep(max(0.0, started_s + t_s - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(int(rng.integers(len(pool))), t_s)))
        await asyncio.gather(*tasks)
        await sampling
    return records, samples


def memory_report(samples: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    report = {}
    for name in names:
        points = [(s["t_s"], s[name]) for s in samples if s.get(name) is not None and s["t_s"] >= 60]
        if len(points) < 2:
            report[name] = None
            continue
        t = np.array([p[0] for p in points]) / 3600
        mb = np.array([p[1] for p in points]) / 2**20
        slope = float(np.polyfit(t, mb, 1)[0])
        half = len(mb) // 2  # a leak keeps growing; a high-water mark (more requests at once) stops
        report[name] = {"rss_mb_minute_1": round(float(mb[0]), 1), "rss_mb_end": round(float(mb[-1]), 1),
                        "growth_mb": round(float(mb[-1] - mb[0]), 1), "growth_mb_per_hour": round(slope, 1),
                        "growth_mb_second_half": round(float(mb[-1] - mb[half]), 1)}
    return report


def latency_by_minute(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_minute: dict[int, list[float]] = {}
    for r in records:
        if r["ok"]:
            by_minute.setdefault(int(r["sent_s"] // 60), []).append(r["elapsed_s"])
    return [{"minute": m + 1, "requests": len(v), "p50_s": round(float(np.percentile(v, 50)), 2),
             "p99_s": round(float(np.percentile(v, 99)), 2)} for m, v in sorted(by_minute.items())]


def plot(samples: list[dict[str, Any]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name in names:
        points = [(s["t_s"] / 60, s[name] / 2**20) for s in samples if s.get(name) is not None]
        after_warmup = [mb for minute, mb in points if minute >= 1]
        if points and after_warmup:  # growth from minute 1: the absolute sizes differ 10x
            ax.plot([m for m, _ in points], [mb - after_warmup[0] for _, mb in points],
                    label=f"{name} ({after_warmup[0]:.0f} MiB at minute 1)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("minutes of load")
    ax.set_ylabel("resident memory minus minute 1 (MiB)")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    pool = request_pool(48, args.seed)
    base = start_local_serve()
    try:
        deploy(args.replicas, args.model)
        harness.wait_for_replicas(APP, args.replicas, 120)
        tracked = processes(APP)
        measured = asyncio.run(capacity(base, pool, args.capacity_s))
        rate = measured * args.load
        print(f"soak: capacity {measured:.2f} req/s; offering {rate:.2f} req/s for {args.minutes:g} min", flush=True)
        records, samples = asyncio.run(soak(base, pool, rate, args.minutes, args.seed, tracked))
    finally:
        stop_local_serve()
    names = sorted(tracked)
    ok = [r for r in records if r["ok"]]
    summary = {"capacity_rps": round(measured, 3), "offered_rps": round(rate, 3), "minutes": args.minutes,
               "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
               "error_codes": sorted({r["error"] for r in records if not r["ok"] and r["error"]}),
               "latency_by_minute": latency_by_minute(records), "memory": memory_report(samples, names),
               "wall_s": round(time.monotonic() - started_s)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "memory.json").write_text(json.dumps(samples))
    plot(samples, names, args.out / "soak_memory.png")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
