"""Chaos: steady load on 3 replicas while replicas are killed (SIGKILL) and frozen (SIGSTOP).

    python -m loadtest.faults.bench_chaos [--quick] [--minutes M] [--fault-every-s N] [--out bench_results/chaos]

The script deploys the iterserve application (the tiny model by default, `--model`; 3 LLMServer
replicas, engine steps padded to 40 ms so that a request lasts seconds, as on a loaded GPU) on a
local Ray, and answers
every request of a fixed pool once with no fault (the reference). Then for M minutes it sends
streamed requests from that pool at a steady Poisson rate (half greedy, half seeded sampling, so
each has one right answer), and every N seconds kills a random live replica or freezes another,
in turn; a frozen replica is thawed after 30 s if Serve has not replaced it by then.

Every request must complete whole with the reference's text, or end with a clear error after its
bounded retries; none may hang (the client gives up at 180 s and counts it). The last line is one
JSON object: requests, completed_whole, identical_to_fault_free, failed_with_error, hung, kills,
freezes, max_stall_s (the longest silence any client saw), and latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.faults import harness
from loadtest.local_serve import start_local_serve, stop_local_serve

APP = "iterserve"
REPO_ROOT = Path(__file__).resolve().parents[2]
# A client waits at most this long for a request: past it, the request counts as hung.
CLIENT_DEADLINE_S = 180.0
# A frozen replica that Serve has not replaced after this long is thawed.
THAW_AFTER_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 minutes of faults (about 4 minutes in all)")
    p.add_argument("--minutes", type=float, default=None, help="minutes of faults (default 6; quick 2)")
    p.add_argument("--fault-every-s", type=float, default=None, help="seconds between faults (default 20; quick 15)")
    p.add_argument("--rate", type=float, default=3.0, help="requests per second")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--pool", type=int, default=48, help="distinct requests (each with a reference answer)")
    p.add_argument("--step-s", type=float, default=0.04, help="engine steps padded to this long")
    p.add_argument("--model", default="tiny",
                   help="the model every replica serves (default: the tiny random model, so that replicas, "
                        "not this machine's cores, set the pace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "chaos")
    args = p.parse_args(argv)
    args.minutes = args.minutes or (2.0 if args.quick else 6.0)
    args.fault_every_s = args.fault_every_s or (15.0 if args.quick else 20.0)
    return args


def request_pool(size: int, seed: int) -> list[dict[str, Any]]:
    """Bodies with one right answer each: greedy, or sampled with a seed."""
    rng = random.Random(seed)
    pool = []
    for k in range(size):
        words = " ".join(rng.choice(("batch", "cache", "block", "token", "replica", "stream", "prefix"))
                         for _ in range(rng.randint(4, 60)))
        body: dict[str, Any] = {"prompt": f"Chaos request {k}: {words}", "max_tokens": rng.randint(20, 90),
                                "ignore_eos": True}
        if k % 2:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + k)
        else:
            body["temperature"] = 0
        pool.append(body)
    return pool


def deploy(args: argparse.Namespace) -> None:
    from ray import serve

    from deployments.app import build_app

    app_args = {"model": args.model, "num_replicas": args.replicas,
                "engine_args": {"num_threads": 1, "max_num_seqs": 64, "emulated_step_time_s": args.step_s},
                "admission": {"max_waiting_requests": 100_000}}
    serve.run(build_app(app_args), name=APP, route_prefix="/")


async def references(base: str, pool: list[dict[str, Any]]) -> list[str]:
    """Each pool request's text with no fault, 8 at a time."""
    limit = asyncio.Semaphore(8)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
        async with limit:
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_DEADLINE_S) as client:
        return list(await asyncio.gather(*(one(client, body) for body in pool)))


class Chaos:
    """Kills and freezes replicas on a schedule, from a thread (signals and Serve calls block)."""

    def __init__(self, every_s: float, seed: int) -> None:
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.log = harness.FaultLog()
        self.stop = threading.Event()
        self.started_s = time.monotonic()
        self._frozen: list[tuple[float, int]] = []

    def run(self) -> None:
        kind = "kill"
        while not self.stop.wait(self.every_s):
            self._thaw_old()
            live = harness.live_replicas(APP)
            if len(live) < 2:  # never take the last live replica: that is an outage, not a fault
                continue
            victim = self.rng.choice(live)
            now_s = time.monotonic()
            if kind == "kill":
                harness.kill(victim)
            else:
                harness.freeze(victim)
                self._frozen.append((now_s, victim.pid))
            self.log.add(now_s - self.started_s, kind, victim)
            print(f"chaos: t={now_s - self.started_s:.0f}s {kind} replica {victim.replica_id} (pid {victim.pid})",
                  flush=True)
            kind = "freeze" if kind == "kill" else "kill"
        for _, pid in self._frozen:
            harness.thaw(pid)

    def _thaw_old(self) -> None:
        now_s = time.monotonic()
        for frozen_s, pid in [f for f in self._frozen if now_s - f[0] > THAW_AFTER_S]:
            harness.thaw(pid)
            self._frozen.remove((frozen_s, pid))


async def load(base: str, pool: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Poisson arrivals for args.minutes; every request recorded with what its client saw."""
    rng = np.random.default_rng(args.seed)
    duration_s = args.minutes * 60
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_DEADLINE_S, limits=limits) as client:
        async def one(index: int, k: int, sent_s: float) -> None:
            outcome = await harness.stream_completion(client, pool[k], CLIENT_DEADLINE_S)
            records.append({"index": index, "pool": k, "sent_s": round(sent_s, 3), **outcome.to_dict()})

        tasks, started_s, t_s, index = [], time.monotonic(), 0.0, 0
        while True:
            t_s += rng.exponential(1 / args.rate)
            if t_s > duration_s:
                break
            await asyncio.sleep(max(0.0, started_s + t_s - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(index, int(rng.integers(len(pool))), t_s)))
            index += 1
        await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r["index"])


def judge(records: list[dict[str, Any]], pool: list[dict[str, Any]], reference: list[str]) -> list[dict[str, Any]]:
    for r in records:
        body = pool[r["pool"]]
        r["whole"] = (r["status"] == 200 and r["error"] is None and not r["hung"] and r["transport_error"] is None
                      and r["finish_reason"] == "length" and r["completion_tokens"] == body["max_tokens"])
        r["identical"] = r["whole"] and r["text"] == reference[r["pool"]]
        r["greedy"] = body.get("temperature") == 0
    return records


def headline(records: list[dict[str, Any]], log: harness.FaultLog) -> dict[str, Any]:
    whole = [r for r in records if r["whole"]]
    failed = [r for r in records if not r["whole"] and not r["hung"]]
    latencies = sorted(r["elapsed_s"] for r in whole)
    greedy = [r for r in whole if r["greedy"]]
    return {
        "requests": len(records),
        "completed_whole": len(whole),
        "identical_to_fault_free": sum(r["identical"] for r in records),
        "identical_greedy": f"{sum(r['identical'] for r in greedy)}/{len(greedy)}",
        "identical_seeded": f"{sum(r['identical'] for r in whole if not r['greedy'])}/{len(whole) - len(greedy)}",
        "failed_with_error": len(failed),
        "errors": sorted({(r["error"] or {}).get("code") or r["transport_error"] or f"status {r['status']}"
                          for r in failed}),
        "hung": sum(r["hung"] for r in records),
        "kills": log.count("kill"),
        "freezes": log.count("freeze"),
        "max_stall_s": round(max((r["max_gap_s"] for r in records), default=0.0), 2),
        "latency_p50_s": _pct(latencies, 50), "latency_p99_s": _pct(latencies, 99),
        "latency_max_s": round(latencies[-1], 2) if latencies else None,
    }


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def plot(records: list[dict[str, Any]], log: harness.FaultLog, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for ok, color, label in ((True, "tab:blue", "completed whole"), (False, "tab:red", "error or hung")):
        points = [(r["sent_s"], r["elapsed_s"]) for r in records if r["whole"] == ok]
        if points:
            ax.scatter(*zip(*points), s=8, color=color, label=label)
    for event in log.events:
        ax.axvline(event["t_s"], color="black" if event["fault"] == "kill" else "tab:orange", lw=0.8,
                   ls="-" if event["fault"] == "kill" else "--")
    ax.set_xlabel("request sent at (s); black: a replica killed, orange dashed: one frozen")
    ax.set_ylabel("request latency (s)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    pool = request_pool(args.pool, args.seed)
    base = start_local_serve()
    try:
        deploy(args)
        harness.wait_for_replicas(APP, args.replicas, 120)
        reference = asyncio.run(references(base, pool))
        print(f"chaos: {len(pool)} reference answers in {time.monotonic() - started_s:.0f}s", flush=True)
        chaos = Chaos(args.fault_every_s, args.seed)
        thread = threading.Thread(target=chaos.run, daemon=True)
        thread.start()
        try:
            records = asyncio.run(load(base, pool, args))
        finally:
            chaos.stop.set()
            thread.join(60)
    finally:
        stop_local_serve()
    records = judge(records, pool, reference)
    summary = headline(records, chaos.log)
    summary.update(minutes=args.minutes, fault_every_s=args.fault_every_s, rate=args.rate, replicas=args.replicas,
                   wall_s=round(time.monotonic() - started_s))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (args.out / "faults.json").write_text(json.dumps(chaos.log.events, indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(records, chaos.log, args.out / "chaos_latency.png")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
