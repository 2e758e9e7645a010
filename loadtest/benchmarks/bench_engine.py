"""Engine benchmark: our continuous and static batching against transformers' `generate` in static
batches and transformers' own continuous batching, on requests sampled from the Azure LLM trace.

    python -m loadtest.benchmarks.bench_engine            # full run (200 requests, ~6 minutes on 2 cores)
    python -m loadtest.benchmarks.bench_engine --quick    # 40 requests, under 2 minutes

Every system runs the same requests (token ids, output lengths, arrival times), greedy, EOS
ignored, on 2 torch threads. Two arrival patterns: all at t=0, and Poisson at --poisson-rate.
Prints one table per pattern, then our engine's forward-time efficiency, and as its last stdout
line one JSON object (headline keys from the t=0 pattern; the Poisson ones under "poisson").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from loadtest.benchmarks import hf_baselines as hf
from loadtest.benchmarks.cpu_contention import ContentionWindow
from loadtest.engine_driver import measure_efficiency, run_engine
from loadtest.results import RequestResult, RunSummary, format_table, summarize_offline
from loadtest.traces import (
    BenchRequest,
    LengthScaler,
    all_at_once,
    build_workload,
    default_trace_path,
    load_azure_trace,
    normal_token_ids,
    poisson_arrivals,
    sample_lengths,
)
from model_worker import EngineConfig, LLMEngine, SamplingParams, resolve_model

SYSTEMS = ("continuous", "static", "hf_generate", "hf_continuous")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Untimed requests each system serves first, so lazy initialisation (kernels, allocator pools,
# the HF manager's thread) is not billed to the first measured requests.
NUM_WARMUP_REQUESTS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 requests (under 2 minutes in all)")
    p.add_argument("--num-requests", type=int, default=None, help="default 200, or 40 with --quick")
    p.add_argument("--trace", type=Path, default=None, help="Azure trace CSV (default: the conversation trace shipped with iterserve)")
    p.add_argument("--model", default=None,
                   help='checkpoint dir, .gguf file or "tiny" (default: the embedded SmolLM2-135M-Instruct)')
    p.add_argument("--dtypes", default="float32",
                   help="comma-separated dtypes, each running every system (ours and transformers) in it: "
                        "float32, bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poisson-rate", type=float, default=None,
                   help="requests/s of the Poisson pattern (default 8)")
    p.add_argument("--prompt-divisor", type=float, default=4.0)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--output-divisor", type=float, default=2.0)
    p.add_argument("--output-min", type=int, default=4)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--patterns", default="t0,poisson", help="comma-separated subset of t0,poisson")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of the t=0 pattern, systems interleaved, median reported (default 3, 1 with --quick)")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig().max_num_seqs,
                   help="ours, both modes (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens,
                   help="ours, both modes (default: the engine's)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of HF generate")
    # HF continuous batching; unset ones take HFContinuousOptions' tuned defaults.
    p.add_argument("--hf-cb-attn", default=None, help="sdpa (default) or paged|eager")
    p.add_argument("--hf-cb-page-size", type=int, default=None, help="default 32")
    p.add_argument("--hf-cb-num-blocks", type=int, default=None, help="default 2048")
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=None, help="default 512")
    p.add_argument("--hf-cb-max-requests", type=int, default=None, help="default 32")
    p.add_argument("--no-efficiency", action="store_true", help="skip the forward-time efficiency window")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 40 if args.quick else 200
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.poisson_rate is None:
        args.poisson_rate = 8.0
    args.systems = [s for s in args.systems.split(",") if s]
    args.patterns = [s for s in args.patterns.split(",") if s]
    args.dtypes = [s for s in args.dtypes.split(",") if s]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes takes a comma-separated subset of {','.join(DTYPES)}")
    unknown = set(args.systems) - set(SYSTEMS) | set(args.patterns) - {"t0", "poisson"}
    if unknown:
        p.error(f"unknown systems or patterns: {sorted(unknown)}")
    return args


def build_workloads(args: argparse.Namespace, vocab_size: int, special_ids: list[int]
                    ) -> dict[str, list[BenchRequest]]:
    """One workload per arrival pattern. Both take the same sampled lengths, but each gets its own
    prompts, so our prefix cache cannot serve the second pattern from the first."""
    trace_path = args.trace or default_trace_path()
    rows = load_azure_trace(trace_path)
    scaler = LengthScaler(args.prompt_divisor, args.prompt_min, args.prompt_max,
                          args.output_divisor, args.output_min, args.output_max)
    lengths = sample_lengths(rows, args.num_requests, scaler, seed=args.seed)
    pool = normal_token_ids(vocab_size, special_ids)
    arrivals = {"t0": all_at_once(args.num_requests),
                "poisson": poisson_arrivals(args.num_requests, args.poisson_rate, seed=args.seed)}
    return {name: build_workload(lengths, arrivals[name], pool, seed=args.seed + 1 + i)
            for i, name in enumerate(arrivals) if name in args.patterns}


def warmup_workload(workload: list[BenchRequest]) -> list[BenchRequest]:
    """A few short requests made of the workload's tokens, renamed so ids never clash."""
    return [BenchRequest(f"warmup-{i}", r.prompt_token_ids[:32][::-1], min(r.output_tokens, 8), 0.0)
            for i, r in enumerate(workload[:NUM_WARMUP_REQUESTS])]


class Runners:
    """Builds each system once and runs workloads through it."""

    def __init__(self, args: argparse.Namespace, model_path: str, dtype: str) -> None:
        torch.set_num_threads(args.threads)
        self.args = args
        self.model_path = model_path
        self.dtype = dtype
        self._built: dict[str, Any] = {}

    def _engine(self, batching: str) -> LLMEngine:
        if batching not in self._built:
            self._built[batching] = LLMEngine(EngineConfig(
                model=self.model_path, batching=batching, max_num_seqs=self.args.max_num_seqs,
                max_num_batched_tokens=self.args.max_num_batched_tokens, num_threads=self.args.threads,
                dtype=self.dtype))
        return self._built[batching]

    def _hf_model(self) -> torch.nn.Module:
        if "hf" not in self._built:
            self._built["hf"] = hf.load_hf_model(self.model_path, num_threads=self.args.threads,
                                                 dtype=DTYPES[self.dtype])
        return self._built["hf"]

    def run(self, system: str, workload: list[BenchRequest], pad_id: int) -> list[RequestResult]:
        if system in ("continuous", "static"):
            engine = self._engine(system)
            engine.reset_prefix_cache()  # each round starts cold: its prompts were seen before
            return run_engine(engine, workload, greedy_params)
        if system == "hf_generate":
            return hf.run_hf_generate(self._hf_model(), workload, self.args.hf_batch_size, pad_id)
        return hf.run_hf_continuous(self._hf_model(), workload, hf_cb_options(self.args))

    def efficiency(self, token_pool: np.ndarray) -> dict[str, float]:
        result = measure_efficiency(self._engine("continuous"), greedy_params, token_pool)
        return {"efficiency": result.efficiency, "efficiency_forward_s": result.forward_s,
                "efficiency_wall_s": result.wall_s, "efficiency_steps": result.num_steps,
                "efficiency_tokens_per_s": result.num_tokens / result.wall_s if result.wall_s else 0.0}


def hf_cb_options(a: argparse.Namespace) -> hf.HFContinuousOptions:
    given = {"attn_implementation": a.hf_cb_attn, "page_size": a.hf_cb_page_size,
             "num_blocks": a.hf_cb_num_blocks, "max_batch_tokens": a.hf_cb_max_batch_tokens,
             "max_requests_per_batch": a.hf_cb_max_requests}
    return hf.HFContinuousOptions(**{k: v for k, v in given.items() if v is not None})


def matmul_gflops(threads: int) -> float:
    """A 0.3 s probe of what the CPU delivers right now. On a shared machine it swings with the
    neighbours' load; printed next to each run so a reader can tell a slow system from a slow
    machine."""
    torch.set_num_threads(threads)
    a = torch.randn(512, 512)
    a @ a
    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < 0.3:
        a @ a
        reps += 1
    return reps * 2 * 512**3 / (time.perf_counter() - start) / 1e9


def greedy_params(num_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)


def _load_tokenizer(model_path: str) -> tuple[Any, int, int]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vocab_size = min(len(tokenizer), AutoConfig.from_pretrained(model_path).vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return tokenizer, vocab_size, pad_id


def headline(results: dict[str, dict[str, RunSummary]]) -> dict[str, float]:
    """Flat keys for one pattern: <system>_tokens_per_s, _ttft_p50_s/_p99_s, _e2e_p50_s/_p99_s,
    and the ratios of our continuous mode over each other system."""
    out: dict[str, float] = {}
    for system, s in results.items():
        out[f"{system}_tokens_per_s"] = s.useful_tokens_per_s
        for name in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"):
            out[f"{system}_{name}"] = getattr(s, name)
    if "continuous" in results:
        ours = results["continuous"].useful_tokens_per_s
        for other in ("static", "hf_continuous", "hf_generate"):
            if other in results:
                out[f"continuous_over_{other}"] = ours / results[other].useful_tokens_per_s
    return out


def run_systems(args: argparse.Namespace, runners: Runners, workloads: dict[str, list[BenchRequest]],
                pad_id: int) -> tuple[dict[str, dict[str, RunSummary]], dict[str, dict[str, dict]]]:
    """Each system, warmed up, through each pattern. The t=0 pattern runs `--repeats` rounds with
    the systems interleaved (A B C D A B C D ...), so a slow spell of this shared machine hits
    every system alike; each system reports its median-throughput round. Returns summaries and,
    per system, every round's tokens/s, how fast the CPU was and how much of it other processes
    took (pattern -> system -> ...)."""
    started = time.perf_counter()
    runs: dict[str, dict[str, list[tuple[RunSummary, dict]]]] = {p: {s: [] for s in args.systems} for p in workloads}
    for system in args.systems:
        runners.run(system, warmup_workload(next(iter(workloads.values()))), pad_id)
    for round_index in range(max(args.repeats, 1)):
        for pattern, workload in workloads.items():
            if pattern != "t0" and round_index > 0:
                continue
            for system in args.systems:
                gflops = matmul_gflops(args.threads)
                window = ContentionWindow.start()
                summary = summarize_offline(runners.run(system, workload, pad_id))
                foreign = window.foreign_share()
                runs[pattern][system].append((summary, {"machine_gflops": gflops, "foreign_cpu_share": foreign}))
                busy = f"  (other processes took {foreign:.0%} of the CPU: noisy)" if (foreign or 0) > 0.1 else ""
                print(f"[{time.perf_counter() - started:6.1f}s] {pattern:<8} {system:<14} round {round_index + 1} "
                      f"{summary.useful_tokens_per_s:8.1f} tok/s, matmul {gflops:.0f} GFLOP/s{busy}",
                      file=sys.stderr, flush=True)
    results: dict[str, dict[str, RunSummary]] = {p: {} for p in workloads}
    noise: dict[str, dict[str, dict]] = {p: {} for p in workloads}
    for pattern, by_system in runs.items():
        for system, rounds in by_system.items():
            ordered = sorted(rounds, key=lambda run: run[0].useful_tokens_per_s)
            summary, readings = ordered[(len(ordered) - 1) // 2]
            results[pattern][system] = summary
            noise[pattern][system] = {**readings, "rounds_tokens_per_s": [r[0].useful_tokens_per_s for r in rounds]}
    return results, noise


def run_dtype(args: argparse.Namespace, runners: Runners, workloads: dict[str, list[BenchRequest]], pad_id: int,
              vocab_size: int, special_ids: list[int]) -> dict[str, Any]:
    """Every system in one dtype, through every pattern: its report."""
    report: dict[str, Any] = {}
    print(f"\n=== {runners.dtype} ===", flush=True)
    results, noise = run_systems(args, runners, workloads, pad_id)
    for pattern, by_system in results.items():
        label = "all at t=0" if pattern == "t0" else f"Poisson arrivals at {args.poisson_rate:g} req/s"
        print(f"\n{len(workloads[pattern])} requests, {label}, {runners.dtype}:\n{format_table(by_system)}")
        if pattern == "t0":
            report.update(headline(by_system))
        else:
            report[pattern] = headline(by_system)
        report.setdefault("details", {})[pattern] = {
            system: {**summary.as_dict(), **noise[pattern][system]} for system, summary in by_system.items()}
    if not args.no_efficiency and "continuous" in args.systems:
        report.update(runners.efficiency(normal_token_ids(vocab_size, special_ids)))
        print(f"\nour continuous mode, 32 running: forward / wall = {report['efficiency']:.3f} "
              f"over {report['efficiency_steps']} steps")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil nags on CPU
    started = time.perf_counter()
    args.model = resolve_model(args.model)
    tokenizer, vocab_size, pad_id = _load_tokenizer(args.model)
    special_ids = list(tokenizer.all_special_ids)
    workloads = build_workloads(args, vocab_size, special_ids)
    by_dtype: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes:
        by_dtype[dtype] = run_dtype(args, Runners(args, args.model, dtype), workloads, pad_id, vocab_size, special_ids)
    # The first dtype's figures are the headline keys; every dtype's are under "by_dtype".
    report: dict[str, Any] = {**by_dtype[args.dtypes[0]], "by_dtype": by_dtype}
    report["config"] = {
        "num_requests": args.num_requests, "poisson_rate": args.poisson_rate, "seed": args.seed,
        "threads": args.threads, "hf_batch_size": args.hf_batch_size, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "hf_cb": asdict(hf_cb_options(args)), "model": args.model,
        "dtypes": args.dtypes, "quick": args.quick, "repeats": args.repeats, "total_s": time.perf_counter() - started,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
