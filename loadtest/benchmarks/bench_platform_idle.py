"""What Ray and Serve cost the engine alone while they serve nothing.

    python -m loadtest.benchmarks.bench_platform_idle [--rounds 3] [--serving-path proxy] [--out DIR]
                                                      [bench_serving_path's workload flags: --dtype, --quick, ...]

bench_serving_path compares the served system with the engine alone on an otherwise quiet machine
(http_over_offline_throughput, tpot_over_offline_tpot). On a machine of a few cores the served
system also carries Ray's and Serve's own processes, which run whether or not a request comes.
This measures their share alone. iterserve's application is served on a local Ray and nothing is
asked of it. Meanwhile bench_serving_path's offline run (the batch-1 decode step, the light-load
replay, every request at once, the same requests) runs in a process of its own. It runs in turns:
- once with every process of that Ray stopped by SIGSTOP: GCS, raylet, the dashboard processes,
  the log monitor, the workers, Serve's controller and proxy, the application's replicas and their
  engine processes;
- once with them running as they idle.

The ratios of the two are a ceiling on the served system's ratios to the engine alone on this
machine, whatever the serving path does per request. The CPU each of those processes took while
idle is read from /proc. The driver of this script stays up through both turns, so the figures
slightly understate what an idle Ray costs.

The last line printed is one JSON object: the figures of each turn per round, their medians, the
ratios idle_over_stopped_tokens_per_s and idle_over_stopped_tpot, and the platform's idle CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from deployments.local_ray import DEFAULT_SERVING_PATH, SERVING_PATHS
from loadtest.bench_cli import token_pool, write_figures
from loadtest.benchmarks import bench_serving_path as bsp

REPO_ROOT = Path(__file__).resolve().parents[2]
TURNS = ("stopped", "idle")  # the platform stopped, the platform running with nothing to do


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(this script's flags, the rest): the rest are bench_serving_path's workload and engine flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the two turns (default 3)")
    p.add_argument("--serving-path", choices=SERVING_PATHS, default=DEFAULT_SERVING_PATH)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "platform_idle")
    p.add_argument("--engine-alone", action="store_true", help=argparse.SUPPRESS)  # one turn's child process
    args, rest = p.parse_known_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    bsp.parse_args(rest)  # the workload flags' errors now, not in a child process
    return args, rest


def engine_alone(rest: list[str]) -> dict[str, float]:
    """bench_serving_path's offline run, reduced to the figures the ratios need."""
    args = bsp.parse_args(rest)
    burst, light = bsp.workloads(args, token_pool(args.model))
    off = bsp.offline(args, burst, light)
    return {"decode_step_ms": off["decode_step_ms"], "tokens_per_s": off["tokens_per_s"],
            "tpot_p50_ms": off["light"]["tpot_s"]["p50"] * 1000, "ttft_p50_ms": off["light"]["ttft_s"]["p50"] * 1000}


def descendants() -> dict[int, str]:
    """pid -> label of every process this one started, and theirs: a local Ray's whole tree."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            found[proc.pid] = process_label(proc.name(), proc.cmdline())
    return found


def process_label(name: str, cmdline: list[str]) -> str:
    """A Python process by its script (Ray's log monitor, dashboard and monitor run as `python X.py`)."""
    if name.startswith("python"):
        script = next((arg for arg in cmdline[1:] if arg.endswith(".py")), None)
        return f"python {os.path.basename(script)}" if script else f"python {' '.join(cmdline[1:2])}".strip()
    return name


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """Every process of `pids` stopped (SIGSTOP) for the block, continued after it, whatever happens."""
    done = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                done.append(pid)
        yield
    finally:
        for pid in done:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            out[pid] = times.user + times.system
    return out


def cpu_by_name(pids: dict[int, str], cpu_s: dict[int, float], wall_s: float) -> dict[str, float]:
    """Share of one core each process label took over wall_s (cpu_s: pid -> CPU-seconds), largest first."""
    shares: dict[str, float] = {}
    for pid, seconds in cpu_s.items():
        shares[pids[pid]] = shares.get(pids[pid], 0.0) + seconds / wall_s
    return {name: round(share, 4) for name, share in sorted(shares.items(), key=lambda kv: -kv[1])}


def run_turn(rest: list[str]) -> dict[str, float]:
    """One turn: the engine alone in a fresh process; its figures from the JSON line it prints."""
    proc = subprocess.run([sys.executable, "-m", "loadtest.benchmarks.bench_platform_idle", "--engine-alone", *rest],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine-alone turn failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians per turn and the ratios of the idle turn to the stopped one."""
    medians = {turn: {key: statistics.median(r[turn][key] for r in rounds) for key in rounds[0][turn]} for turn in TURNS}
    return {"median": medians,
            "idle_over_stopped_tokens_per_s": medians["idle"]["tokens_per_s"] / medians["stopped"]["tokens_per_s"],
            "idle_over_stopped_tpot": medians["idle"]["tpot_p50_ms"] / medians["stopped"]["tpot_p50_ms"],
            "idle_over_stopped_decode_step": medians["idle"]["decode_step_ms"] / medians["stopped"]["decode_step_ms"]}


def answer_a_few(client: Any, burst: list[Any]) -> None:
    """bench_serving_path's four warm-up requests; raises unless each one completes."""
    bsp._check_all_ok("short requests", bsp._warm_up(client, burst))


def serve_idle_app(args: argparse.Namespace, rest: list[str]) -> tuple[Any, list[Any]]:
    """iterserve's application on a local Ray, one replica, past its first requests: (a client
    config for it, the workload's burst)."""
    from ray import serve

    from deployments.app import build_app
    from loadtest.client import ClientConfig
    from loadtest.local_serve import start_local_serve

    work = bsp.parse_args(rest)
    base = start_local_serve(serving_path=args.serving_path)
    serve.run(build_app({"model": work.model, "engine_args": bsp._engine_args(work), "num_replicas": 1}),
              name="iterserve", route_prefix="/")
    client, (burst, _) = ClientConfig(base, sample_interval_s=0), bsp.workloads(work, token_pool(work.model))
    answer_a_few(client, burst)
    return client, burst


def measure(args: argparse.Namespace, rest: list[str]) -> dict[str, Any]:
    from loadtest.local_serve import stop_local_serve

    try:
        client, burst = serve_idle_app(args, rest)
        time.sleep(5)  # past the deployment's start-up work
        platform = descendants()
        rounds, idle_cpu, idle_wall_s = [], {}, 0.0
        for i in range(args.rounds):
            with stopped(list(platform)):
                stopped_figures = run_turn(rest)
            before, started_s = cpu_seconds(platform), time.monotonic()
            idle_figures = run_turn(rest)
            idle_wall_s += time.monotonic() - started_s
            after = cpu_seconds(platform)
            for pid in before.keys() & after.keys():
                idle_cpu[pid] = idle_cpu.get(pid, 0.0) + after[pid] - before[pid]
            rounds.append({"stopped": stopped_figures, "idle": idle_figures})
            print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        by_name = cpu_by_name(platform, idle_cpu, idle_wall_s)
        answer_a_few(client, burst)  # the application outlived its stops
        return {"rounds": rounds, **summarize(rounds), "platform_processes": len(platform),
                "platform_idle_cpu_share_of_a_core": round(sum(by_name.values()), 4),
                "platform_idle_cpu_by_process": by_name}
    finally:
        stop_local_serve()


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(argv)
    if args.engine_alone:
        print(json.dumps(engine_alone(rest)), flush=True)
        return 0
    started_s = time.monotonic()
    figures = measure(args, rest)
    figures["config"] = {"serving_path": args.serving_path, "rounds": args.rounds, "workload_args": rest,
                         "cpu_count": os.cpu_count(), "total_s": time.monotonic() - started_s}
    write_figures(args.out, "platform_idle", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
