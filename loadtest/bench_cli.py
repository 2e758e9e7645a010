"""`iterserve bench`: load a running OpenAI-compatible server with a workload, report what it did.

    iterserve bench --workload synthetic --rate 2,4,8 --num-requests 100 --slo-ttft 1.0 --out bench_out
    iterserve bench --workload trace --rate 4 --num-requests 200
    iterserve bench --workload shared-prefix --prefixes 4 --rate 8
    iterserve bench --workload multi-turn --turns 4 --mode closed --concurrency 8

Writes results.jsonl (one line per request), summary.json, runs.json (everything, so the report
can be rebuilt) and report.md with its plots into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import workloads as wl
from loadtest.client import ClientConfig, run_load
from loadtest.results import SLO, summarize
from loadtest.traces import BenchRequest, LengthScaler, default_trace_path, load_azure_trace, normal_token_ids

WORKLOADS = ("synthetic", "trace", "shared-prefix", "multi-turn")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="load a running server with a workload and write a report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback unless --allow-remote)")
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="`model` to send (default: the server's)")
    p.add_argument("--tokenizer", default=None, help='tokenizer for prompt ids: a checkpoint or "tiny" (default: the embedded SmolLM2\'s)')
    add_workload_arguments(p)
    p.add_argument("--mode", choices=("open", "closed"), default="open")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT bound, seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT bound, seconds")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds per run before cutting off")
    p.add_argument("--label", default="server", help="series name in the report")
    p.add_argument("--out", type=Path, default=Path("bench_out"))


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload options, shared with `iterserve simulate` (simulator/cli.py)."""
    p.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    p.add_argument("--num-requests", type=int, default=100, help="requests (conversations for multi-turn)")
    p.add_argument("--rate", default="4", help="req/s, or a comma list to sweep; 'inf' sends all at once")
    p.add_argument("--arrival", choices=("poisson", "gamma", "burst"), default="poisson")
    p.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation (burstiness)")
    p.add_argument("--prompt-len", default="lognormal:128:8:512", help="KIND:MEAN[:LOW:HIGH[:SIGMA]]")
    p.add_argument("--output-len", default="lognormal:64:4:256", help="KIND:MEAN[:LOW:HIGH[:SIGMA]]")
    p.add_argument("--trace", type=Path, default=None, help="Azure trace CSV (default: the conversation trace shipped with iterserve)")
    p.add_argument("--prompt-divisor", type=float, default=4.0, help="trace: prompt tokens divided by this")
    p.add_argument("--output-divisor", type=float, default=2.0, help="trace: output tokens divided by this")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix: system prompts")
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--think-time", type=float, default=0.5, help="multi-turn: seconds between turns")
    p.add_argument("--batch-fraction", type=float, default=0.0, help="share of requests sent with priority batch")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from loadtest.report import write_report

    pool = token_pool(args.tokenizer)
    rates = parse_rates(args.rate)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    config = ClientConfig(base_url=args.url, api_key=args.api_key, model=args.model, mode=args.mode,
                          concurrency=args.concurrency, max_duration_s=args.max_duration,
                          allow_remote=args.allow_remote)
    runs = []
    for rate in rates:
        workload = build_workload(args, pool, rate)
        label = f"{args.label} @ {_rate_text(rate)}" if args.mode == "open" else \
            f"{args.label} x{args.concurrency} in flight"
        runs.append(measure(workload, config, label, args.label, rate, slo))
        print(summary_line(runs[-1]), flush=True)
    write_outputs(args.out, runs)
    report = write_report(args.out, f"iterserve bench: {args.workload}", runs,
                          notes=[f"command: iterserve {' '.join(sys.argv[1:])}"], slo_ttft_s=args.slo_ttft)
    print(f"report: {report}")
    return 0


def measure(workload: list[BenchRequest], config: ClientConfig, label: str, series: str, rate: float | None,
            slo: SLO) -> dict[str, Any]:
    """One run with a progress bar: the run dict the report takes."""
    from tqdm import tqdm

    with tqdm(total=len(workload), desc=label, unit="req", file=sys.stderr, mininterval=0.5, leave=False) as bar:
        load = asyncio.run(run_load(workload, config, on_done=lambda _: bar.update(1)))
    return {"label": label, "series": series, "rate": rate,
            "concurrency": config.concurrency if config.mode == "closed" else None,
            "summary": summarize(load.results, slo), "results": [r.to_dict() for r in load.results],
            "timeline": load.timeline}


def build_workload(args: argparse.Namespace, pool: np.ndarray, rate: float | None) -> list[BenchRequest]:
    n, seed = args.num_requests, args.seed
    if args.workload == "trace":
        rows = load_azure_trace(args.trace or default_trace_path())
        scaler = LengthScaler(prompt_divisor=args.prompt_divisor, output_divisor=args.output_divisor)
        speedup = 1.0 if rate is None else rate / wl.trace_rate(rows, n)
        workload = wl.trace_replay(rows, n, pool, seed, speedup=speedup, scaler=scaler)
        if rate is None:
            workload = [BenchRequest(r.request_id, r.prompt_token_ids, r.output_tokens, 0.0) for r in workload]
    else:
        times = wl.arrivals(n, rate, args.arrival, seed, args.cv)
        if args.workload == "synthetic":
            workload = wl.synthetic(n, parse_length(args.prompt_len), parse_length(args.output_len), times, pool, seed)
        elif args.workload == "shared-prefix":
            per_prefix = -(-n // args.prefixes)
            times = wl.arrivals(per_prefix * args.prefixes, rate, args.arrival, seed, args.cv)
            workload = wl.shared_prefix(args.prefixes, per_prefix, args.prefix_tokens, args.suffix_tokens,
                                        parse_length(args.output_len).mean, times, pool, seed)
        else:
            workload = wl.multi_turn(n, args.turns, args.prefix_tokens, args.suffix_tokens,
                                     parse_length(args.output_len).mean, times, pool, seed, args.think_time)
    return wl.with_batch_fraction(workload, args.batch_fraction, seed) if args.batch_fraction else workload


def token_pool(tokenizer: str | None) -> np.ndarray:
    """The tokenizer's non-special ids: prompts drawn from them are exactly as long as asked."""
    from model_worker.checkpoints.models import load_tokenizer

    tok = load_tokenizer(tokenizer)  # None: the default model's
    return normal_token_ids(len(tok), tok.all_special_ids)


def parse_rates(text: str) -> list[float | None]:
    rates: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        rate = None if part in ("inf", "burst") else float(part)
        if rate is not None and not rate > 0:
            raise ValueError(f"rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def parse_length(text: str) -> wl.LengthDist:
    parts = text.split(":")
    try:
        kind, mean = parts[0], int(parts[1])
        low = int(parts[2]) if len(parts) > 2 else (mean if kind == "fixed" else 1)
        high = int(parts[3]) if len(parts) > 3 else (mean if kind == "fixed" else 4 * mean)
        sigma = float(parts[4]) if len(parts) > 4 else 0.5
    except (IndexError, ValueError):
        raise ValueError(f"length {text!r}: expected KIND:MEAN[:LOW:HIGH[:SIGMA]]") from None
    return wl.LengthDist(kind, mean, low, high, sigma)  # type: ignore[arg-type]


def summary_line(run: dict[str, Any]) -> str:
    s = run["summary"]
    ms = lambda d, q: "-" if d[q] is None else f"{d[q] * 1000:.0f}"  # noqa: E731
    return (f"{run['label']}: ok {s['num_ok']}/{s['num_requests']} shed {s['num_shed']} errors {s['num_errors']} | "
            f"{s['request_throughput']:.2f} req/s {s['output_throughput']:.0f} tok/s | "
            f"TTFT p50 {ms(s['ttft_s'], 'p50')} p99 {ms(s['ttft_s'], 'p99')} ms | "
            f"TPOT p50 {ms(s['tpot_s'], 'p50')} ms | goodput {s['goodput'] * 100:.0f}%")


def write_outputs(out_dir: Path, runs: list[dict[str, Any]]) -> None:
    from loadtest.report import save_runs

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for run in runs:
            for result in run["results"]:
                f.write(json.dumps({"run": run["label"], **result}) + "\n")
    (out_dir / "summary.json").write_text(json.dumps([{"label": r["label"], "series": r["series"], "rate": r["rate"],
                                                       **r["summary"]} for r in runs], indent=1))
    save_runs(out_dir / "runs.json", runs)


def write_figures(out_dir: Path, name: str, figures: dict[str, Any]) -> None:
    """A benchmark's figures: into out_dir/name.json, and printed as its last line (one JSON object)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures), flush=True)


def _rate_text(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g} req/s"

