"""The autoscaler under a step load, and ingress admission under overload, over HTTP.

    python -m loadtest.benchmarks.bench_autoscaling [--quick] [--out bench_results/autoscaling]

Replicas run the tiny model (`--model` for another) for real, with every engine step padded to --step-time seconds
(EngineConfig.emulated_step_time_s): a GPU's step keeps the device busy, not the host, and with
the padding a replica's capacity is set by its seats and steps, not by this machine's 2 cores, so
4+ replicas can scale here. One replica's capacity C is 60% of its seat throughput,
max_num_seqs / ((output_tokens + 1) * step_time): the rate it serves with TTFT p90 inside the SLO.

Runs, each on a freshly deployed application:
1. step load 1x -> 4x -> 1x of C, autoscaling with warm_spares=0;
2. the same with warm_spares=1;
3. overload: 3x C with 30% batch-priority requests against a deployment capped at 2 replicas
   (1 + 1 warm spare): it can serve 2x C inside the SLO, so the rest must be shed, batch first.

Recovery is the time from the step up until TTFT p90 (per 2-second bin of requests by send time)
is back under the SLO for at least 3 bins in a row; the seconds of bins over the SLO in the 4x
phase are reported beside it. Cold start is the time from Serve starting a
replica to that replica running, as seen in `serve.status()`. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest import workloads as wl
from loadtest.bench_cli import measure, summary_line, token_pool, write_outputs
from loadtest.client import ClientConfig
from loadtest.local_serve import start_local_serve, stop_local_serve
from loadtest.report import write_report
from loadtest.results import SLO
from loadtest.traces import BenchRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter phases (under 8 minutes)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT p90 SLO in seconds (the autoscaler's target)")
    p.add_argument("--max-replicas", type=int, default=6)
    p.add_argument("--max-num-seqs", type=int, default=4, help="seats per replica")
    p.add_argument("--step-time", type=float, default=0.08, help="emulated engine step, seconds")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--scale-down-delay", type=float, default=None, help="default 20 s; quick 15 s")
    p.add_argument("--model", default="tiny",
                   help="the model every replica serves (default: the tiny random model, so that replicas, "
                        "not this machine's cores, set the pace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "autoscaling")
    args = p.parse_args(argv)
    # (1x, 4x, 1x) phase lengths, and (1x warm-up, 3x) for the overload run.
    args.step_phases_s = (15.0, 45.0, 40.0) if args.quick else (30.0, 90.0, 90.0)
    args.overload_phases_s = (10.0, 45.0) if args.quick else (15.0, 90.0)
    args.scale_down_delay = args.scale_down_delay or (15.0 if args.quick else 20.0)
    return args


def capacity_per_s(args: argparse.Namespace) -> float:
    """C: 60% of one replica's seat throughput (a request holds a seat for its prefill step and one
    step per output token)."""
    return 0.6 * args.max_num_seqs / ((args.output_tokens + 1) * args.step_time)


def workload(args: argparse.Namespace, pool: np.ndarray, phases: list[tuple[float, float]], batch_fraction: float,
             seed: int) -> list[BenchRequest]:
    times = wl.step_arrivals(phases, seed)
    fixed = lambda n: wl.LengthDist("fixed", n, n, n)  # noqa: E731
    requests = wl.synthetic(len(times), fixed(args.prompt_tokens), fixed(args.output_tokens), times, pool, seed)
    return wl.with_batch_fraction(requests, batch_fraction, seed) if batch_fraction else requests


def deploy(args: argparse.Namespace, max_replicas: int, warm_spares: int) -> None:
    from ray import serve

    from deployments.app import build_app

    serve.delete("iterserve")
    app_args = {
        "model": args.model,
        "autoscaling": {"min_replicas": 1, "max_replicas": max_replicas, "warm_spares": warm_spares,
                        "target_queue_per_replica": args.max_num_seqs / 2, "ttft_slo_s": args.slo_ttft,
                        "scale_up_delay_s": 2.0, "scale_down_delay_s": args.scale_down_delay},
        # 128 blocks hold every seat's prompt and output many times over; the default (1 GiB of
        # zeros) would only slow each replica's start.
        "engine_args": {"num_threads": 1, "max_num_seqs": args.max_num_seqs, "num_kv_blocks": 128,
                        "emulated_step_time_s": args.step_time},
        "routing_stats_period_s": 0.5, "drain_timeout_s": 30,
        # The replica's own limit stays out of the way: the ingress's admission control is measured.
        "admission": {"max_waiting_requests": 100_000},
        "ingress_admission": {"max_waiting_requests": 512, "batch_max_wait_s": args.slo_ttft / 2},
    }
    serve.run(build_app(app_args), name="iterserve", route_prefix="/")


class ReplicaWatch:
    """serve.status() every 0.25 s in a thread: (time, running, all replicas Serve holds)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray import serve

        while not self._stop.is_set():
            try:
                states = serve.status().applications["iterserve"].deployments["LLMServer"].replica_states
                counts = {str(getattr(s, "value", s)): n for s, n in states.items()}
                self.samples.append((time.monotonic() - self.t0, counts.get("RUNNING", 0),
                                     counts.get("RUNNING", 0) + counts.get("STARTING", 0)))
            except Exception:  # the app is being redeployed
                pass
            self._stop.wait(0.25)

    def wait_for(self, running: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.samples and self.samples[-1][1] == running == self.samples[-1][2]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the deployment did not settle at {running} running replicas in {timeout_s} s")
            time.sleep(0.25)

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples


def cold_starts_s(samples: list[tuple[float, int, int]]) -> list[float]:
    """For each replica Serve started: the time until the running count caught up with it."""
    starts: list[float] = []
    cold = []
    previous_total = previous_running = None
    for t, running, total in samples:
        if previous_total is not None and total > previous_total:
            starts += [t] * (total - previous_total)
        if previous_running is not None and running > previous_running:
            for _ in range(running - previous_running):
                if starts:
                    cold.append(t - starts.pop(0))
        previous_total, previous_running = total, running
    return cold


def ttft_p90_bins(results: list[dict[str, Any]], priority: str | None = None) -> list[tuple[float, float]]:
    """(bin start, TTFT p90) per BIN_S of send time, over the requests that got a first token."""
    bins: dict[int, list[float]] = {}
    for r in results:
        if r["sent_s"] is None or r["first_token_s"] is None or (priority and r["priority"] != priority):
            continue
        bins.setdefault(int(r["sent_s"] // BIN_S), []).append(r["first_token_s"] - r["sent_s"])
    return [(k * BIN_S, float(np.percentile(v, 90))) for k, v in sorted(bins.items())]


def recovery_s(bins: list[tuple[float, float]], step_up_s: float, step_down_s: float, slo_s: float,
               hold_bins: int = 3) -> float:
    """From the step up until TTFT p90 is back under the SLO to stay: the start of the first run of
    `hold_bins` bins (6 s) under it after the first bin over it. 0 if no bin of the high phase broke
    the SLO; the phase's length if it never came back."""
    high = [(start, p90) for start, p90 in bins if step_up_s <= start < step_down_s]
    first_bad = next((i for i, (_, p90) in enumerate(high) if p90 > slo_s), None)
    if first_bad is None:
        return 0.0
    for i in range(first_bad + 1, len(high) - hold_bins + 1):
        if all(p90 <= slo_s for _, p90 in high[i:i + hold_bins]):
            return high[i][0] - step_up_s
    return step_down_s - step_up_s


def violation_s(bins: list[tuple[float, float]], step_up_s: float, step_down_s: float, slo_s: float) -> float:
    """Seconds of the high phase whose bins had TTFT p90 over the SLO."""
    return BIN_S * sum(1 for start, p90 in bins if step_up_s <= start < step_down_s and p90 > slo_s)


def accepted_lost(results: list[dict[str, Any]], wanted: dict[str, int]) -> int:
    """Requests that got 200 and did not end whole (every one asks for a fixed number of tokens),
    plus any failure that is not a 429 refusal."""
    lost = 0
    for r in results:
        if r["status"] == 429:
            continue
        whole = r["error"] is None and r["finish_s"] is not None and r["output_tokens"] == wanted[r["request_id"]]
        lost += r["status"] != 200 or not whole
    return lost


def run_once(args: argparse.Namespace, base: str, label: str, requests: list[BenchRequest], max_replicas: int,
             warm_spares: int) -> tuple[dict[str, Any], list[tuple[float, int, int]]]:
    deploy(args, max_replicas, warm_spares)
    watch = ReplicaWatch(time.monotonic())
    watch.wait_for(min(1 + warm_spares, max_replicas))
    watch.t0 = time.monotonic()  # load starts now: the timeline's zero
    watch.samples.clear()
    run = measure(requests, ClientConfig(base, max_duration_s=900, sample_interval_s=1.0), label, label, None,
                  SLO(ttft_s=args.slo_ttft))
    samples = watch.stop()
    run["replica_samples"] = samples
    print(summary_line(run), flush=True)
    return run, samples


def plot(out_dir: Path, name: str, run: dict[str, Any], args: argparse.Namespace,
         marks_s: list[float]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_q, ax_t) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    samples = run["replica_samples"]
    ax_r.step([s[0] for s in samples], [s[2] for s in samples], where="post", label="asked for (running + starting)")
    ax_r.step([s[0] for s in samples], [s[1] for s in samples], where="post", label="running")
    ax_r.set(ylabel="replicas", title=run["label"])
    ax_q.plot([s["t_s"] for s in run["timeline"]], [s["num_waiting"] for s in run["timeline"]], label="engine queue")
    ax_q.set(ylabel="waiting requests")
    for priority in ("interactive", "batch"):
        bins = ttft_p90_bins(run["results"], priority)
        if bins:
            ax_t.plot([b + BIN_S / 2 for b, _ in bins], [p for _, p in bins], marker=".", label=f"{priority} TTFT p90")
    ax_t.axhline(args.slo_ttft, color="red", linestyle="--", label="SLO")
    ax_t.set(ylabel="seconds", xlabel="time since load started (s)", yscale="log")
    for ax in (ax_r, ax_q, ax_t):
        for mark in marks_s:
            ax.axvline(mark, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def model_load_s(base: str) -> float | None:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    totals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("iterserve_model_load_seconds{") and 'part="total"' in line]
    return float(np.mean(totals)) if totals else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    pool = token_pool(args.model)
    c = capacity_per_s(args)
    low, high, tail = args.step_phases_s
    step = workload(args, pool, [(low, c), (high, 4 * c), (tail, c)], 0.0, args.seed)
    warm, hot = args.overload_phases_s
    overload = workload(args, pool, [(warm, c), (hot, 3 * c)], 0.3, args.seed + 1)
    wanted = {r.request_id: r.output_tokens for r in step}
    wanted_overload = {r.request_id: r.output_tokens for r in overload}
    base = start_local_serve()
    runs, figures = [], {}
    try:
        for spares in (0, 1):
            run, samples = run_once(args, base, f"step 1x-4x-1x, warm_spares={spares}", step, args.max_replicas,
                                    spares)
            runs.append(run)
            bins = ttft_p90_bins(run["results"])
            figures[f"spares{spares}"] = {
                "recovery_s": recovery_s(bins, low, low + high, args.slo_ttft),
                "violation_s": violation_s(bins, low, low + high, args.slo_ttft),
                "max_replicas_seen": max((s[1] for s in samples), default=0),
                "cold_starts_s": cold_starts_s(samples), "lost": accepted_lost(run["results"], wanted),
                "ttft_p90_s": run["summary"]["ttft_s"]["p90"], "model_load_s": model_load_s(base)}
        run, samples = run_once(args, base, "overload 3x, 30% batch, 2 replicas", overload, 2, 1)
        runs.append(run)
    finally:
        stop_local_serve()
    results = run["results"]
    interactive = [r["first_token_s"] - r["sent_s"] for r in results
                   if r["priority"] == "interactive" and r["status"] == 200 and r["first_token_s"] is not None]
    colds = figures["spares0"]["cold_starts_s"] + figures["spares1"]["cold_starts_s"]
    headline = {
        "recovery_s_spares1": figures["spares1"]["recovery_s"], "recovery_s_spares0": figures["spares0"]["recovery_s"],
        "cold_start_s": float(np.median(colds)) if colds else None,
        "model_load_s": figures["spares0"]["model_load_s"], "slo_ttft_s": args.slo_ttft,
        "interactive_ttft_p99_s": float(np.percentile(interactive, 99)) if interactive else None,
        "batch_shed": sum(1 for r in results if r["priority"] == "batch" and r["status"] == 429),
        "batch_sent": sum(1 for r in results if r["priority"] == "batch"),
        "interactive_shed": sum(1 for r in results if r["priority"] == "interactive" and r["status"] == 429),
        "accepted_lost": (figures["spares0"]["lost"] + figures["spares1"]["lost"]
                          + accepted_lost(results, wanted_overload)),
        "max_replicas_seen": max(figures["spares0"]["max_replicas_seen"], figures["spares1"]["max_replicas_seen"]),
        "capacity_per_replica_req_s": c,
        "ttft_p90_s_spares0": figures["spares0"]["ttft_p90_s"], "ttft_p90_s_spares1": figures["spares1"]["ttft_p90_s"],
        "slo_violation_s_spares0": figures["spares0"]["violation_s"],
        "slo_violation_s_spares1": figures["spares1"]["violation_s"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_outputs(args.out, runs)
    images = [plot(args.out, "step_spares0.png", runs[0], args, [low, low + high]),
              plot(args.out, "step_spares1.png", runs[1], args, [low, low + high]),
              plot(args.out, "overload.png", runs[2], args, [warm])]
    notes = [f"command: python -m loadtest.benchmarks.bench_autoscaling {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"one replica: {args.max_num_seqs} seats, {args.step_time * 1000:g} ms steps (emulated), "
             f"{args.prompt_tokens}-token prompts, {args.output_tokens}-token outputs; C = {c:.2f} req/s",
             f"step load: {low:g} s at 1x, {high:g} s at 4x, {tail:g} s at 1x of C; max_replicas {args.max_replicas}; "
             f"TTFT SLO (p90) {args.slo_ttft:g} s; scale_down_delay_s {args.scale_down_delay:g}",
             f"overload: {warm:g} s at 1x then {hot:g} s at 3x of C, 30% batch, 2 replicas (1 + 1 warm spare)",
             "headline: " + json.dumps(headline),
             f"total wall time {time.monotonic() - started_s:.0f}s"]
    write_report(args.out, "Autoscaling and admission", runs, notes=notes)
    with open(args.out / "report.md", "a") as f:
        f.write("\n## Replicas, queue and TTFT p90 over time\n\n" + "".join(f"![{i}]({i})\n\n" for i in images))
    print(json.dumps(headline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
