"""A cancellation storm: many streams, each cut off by its client at a random point.

    python -m loadtest.faults.cancel_storm [--streams 1000] [--concurrency 100] [--replicas 2]

The script deploys the iterserve application on a local Ray and opens `--streams` streamed
completions, `--concurrency` at a time. Each client hangs up at a random point: right after
sending (before any byte came back), after the response headers, after k events, or (a fifth of
them) a unary request whose connection is closed mid-generation. Then every replica must come
back to zero running requests, zero waiting and every KV block free, within `--settle-s`, and the
service must answer a normal request. The last line is one JSON object: streams, how many were
cut at each point, settle_s (until every replica was idle), and per replica num_running,
num_waiting, kv blocks in use and aborted requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from collections import Counter

import httpx

from contracts import RoutingReport
from loadtest.local_serve import start_local_serve, stop_local_serve

APP = "iterserve"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=60.0, help="how long the replicas get to become idle")
    p.add_argument("--model", default="tiny",
                   help="the model every replica serves (default: the tiny random model, so that replicas, "
                        "not this machine's cores, set the pace)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def deploy(replicas: int, model: str | None) -> None:
    from ray import serve

    from deployments.app import build_app

    args = {"model": model, "num_replicas": replicas, "engine_args": {"num_threads": 1, "max_num_seqs": 128},
            "admission": {"max_waiting_requests": 100_000}, "ingress_admission": {"max_waiting_requests": 100_000}}
    serve.run(build_app(args), name=APP, route_prefix="/")


async def cut_stream(client: httpx.AsyncClient, rng: random.Random, index: int) -> str:
    """One stream, abandoned at a random point; returns where."""
    body = {"prompt": f"storm {index} " * rng.randint(1, 40), "max_tokens": rng.randint(50, 400),
            "ignore_eos": True, "stream": True, "temperature": rng.choice((0, 0.9))}
    where = rng.choice(("before_headers", "after_headers", "after_events", "after_events", "after_events"))
    if where == "before_headers":
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return where
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if where == "after_headers":
            return where
        events = rng.randint(1, 30)
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events -= 1
                if events <= 0:
                    break
    return where


def cut_unary(base: str, rng: random.Random, index: int) -> str:
    """A unary request whose connection is closed while it generates."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"prompt": f"unary {index}", "max_tokens": rng.randint(100, 400), "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(rng.uniform(0.05, 0.5))
    return "unary_closed"


async def storm(base: str, args: argparse.Namespace) -> Counter:
    """Run args.streams cut-off requests (args.concurrency at a time); how many were cut where."""
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    where: Counter = Counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)  # a hang-up closes its connection

    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        async def one(index: int) -> None:
            async with limit:
                if index % 5 == 4:
                    where[await asyncio.to_thread(cut_unary, base, rng, index)] += 1
                else:
                    where[await cut_stream(client, rng, index)] += 1

        await asyncio.gather(*(one(i) for i in range(args.streams)))
    return where


def replica_stats(app: str = APP) -> list[RoutingReport]:
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app)
    return [RoutingReport.from_dict(r) for r in handle.broadcast("record_routing_stats").results(timeout_s=10)]


def settle(deadline_s: float, app: str = APP) -> tuple[float | None, list[RoutingReport]]:
    """Seconds until every replica has nothing running or waiting and every KV block free (None
    if that did not happen within deadline_s), and their last stats."""
    started_s = time.monotonic()
    while True:
        stats = replica_stats(app)
        if all(s.num_running == 0 and s.num_queued == 0 and s.num_free_kv_blocks == s.num_total_kv_blocks
               for s in stats):
            return time.monotonic() - started_s, stats
        if time.monotonic() - started_s > deadline_s:
            return None, stats
        time.sleep(0.2)


def aborted_per_replica(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("iterserve_request_success_total{") and 'finished_reason="abort"' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    base = start_local_serve()
    try:
        deploy(args.replicas, args.model)
        where = asyncio.run(storm(base, args))
        storm_s = time.monotonic() - started_s
        settle_s, stats = settle(args.settle_s)
        aborted = aborted_per_replica(base)
        after = httpx.post(f"{base}/v1/completions", json={"prompt": "still here?", "max_tokens": 4}, timeout=60)
        health = httpx.get(f"{base}/health", timeout=30)
    finally:
        stop_local_serve()
    summary = {
        "streams": args.streams, "cut_at": dict(sorted(where.items())), "storm_s": round(storm_s, 1),
        "settle_s": None if settle_s is None else round(settle_s, 2),
        "replicas": [{"replica": s.replica_id, "num_running": s.num_running, "num_queued": s.num_queued,
                      "kv_blocks_in_use": s.num_total_kv_blocks - s.num_free_kv_blocks,
                      "aborted": aborted.get(s.replica_id)} for s in stats],
        "request_after": after.status_code, "health_after": health.status_code,
    }
    summary["idle"] = settle_s is not None and all(r["kv_blocks_in_use"] == 0 for r in summary["replicas"])
    print(json.dumps(summary), flush=True)
    return 0 if summary["idle"] and after.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
