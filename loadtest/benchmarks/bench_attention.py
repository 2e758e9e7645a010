"""Our CPU attention kernels alone, and against an earlier commit's build of them in the same run.

    python -m loadtest.benchmarks.bench_attention                          # this checkout's kernels
    python -m loadtest.benchmarks.bench_attention --before HEAD~1          # and HEAD~1's, interleaved
    python -m loadtest.benchmarks.bench_attention --dtype float32 --prompt-tokens 256 --decode 64x290

SmolLM2-135M-Instruct's heads by default (9 query heads, 3 kv heads, head_dim 64), block size 16,
every sequence's blocks in a random order as a busy engine leaves them (`--block-order in-order`:
each sequence's blocks one after another, as a fresh engine lays them out):
- prompt attention (`ops.prefill_attention`): one prompt of N tokens over its own context, ms a
  layer and its rate (4 head_dim FLOPs per query head per causal pair);
- decode attention (`ops.decode_attention`): ROWS rows of CTX positions each, ms a step over
  --layers layers' caches (each layer's its own, so the caches do not stay in the CPU's caches
  between layers, as in a real step).
Each figure is the median of --repeats runs; with --before the two builds take turns run by run,
so the machine's drift falls on both alike. Also the largest error of each build's result against
float64 SDPA, and in bfloat16 that of torch's own bfloat16 SDPA beside it. Prints a table and, last,
one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from model_worker.runner.cpu_kernels import ops

REPO = Path(__file__).resolve().parents[2]
SOURCE = "model_worker/runner/cpu_kernels/kernels.cpp"
BLOCK_SIZE = 16
BLOCK_ORDERS = ("random", "in-order")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=None, help="a git revision whose kernels.cpp runs beside this checkout's")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head_dim")
    p.add_argument("--prompt-tokens", default="256,1024", help="comma-separated prompt sizes")
    p.add_argument("--decode", default="1x300,8x300,64x290", help="comma-separated ROWSxCTX decode steps")
    p.add_argument("--layers", type=int, default=30, help="layers' caches a decode step reads")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-order", default="random", choices=BLOCK_ORDERS,
                   help="random: as a busy engine leaves a cache; in-order: as a fresh one lays it out")
    args = p.parse_args(argv)
    try:
        args.heads = tuple(int(n) for n in args.heads.split(","))
        args.prompt_tokens = [int(n) for n in args.prompt_tokens.split(",") if n]
        args.decode = [tuple(int(n) for n in case.split("x")) for case in args.decode.split(",") if case]
    except ValueError:
        p.error("--heads, --prompt-tokens and --decode take integers (--decode as ROWSxCTX)")
    num_heads, num_kv_heads, head_dim = args.heads if len(args.heads) == 3 else (0, 0, 0)
    if min(num_heads, num_kv_heads, head_dim) < 1 or num_heads % num_kv_heads:
        p.error("--heads: three positive integers, query heads a multiple of kv heads")
    if any(n < 1 for n in args.prompt_tokens) or any(len(c) != 2 or min(c) < 1 for c in args.decode):
        p.error("--prompt-tokens and --decode must be at least 1 each")
    for name in ("layers", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def source_at(revision: str) -> bytes:
    """kernels.cpp as of a git revision of this repository."""
    try:
        return subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=REPO, capture_output=True, check=True,
                              timeout=60).stdout
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"--before {revision}: {exc.stderr.decode().strip()}") from None


def random_caches(num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    return tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))  # type: ignore[return-value]


def block_ids(num_blocks: int, count: int, in_order: bool, generator: torch.Generator) -> np.ndarray:
    """`count` distinct block ids of the `num_blocks` in a cache: random, or 0, 1, 2, ... in order."""
    ids = torch.arange(num_blocks) if in_order else torch.randperm(num_blocks, generator=generator)
    return ids[:count].numpy()


def gathered(cache: torch.Tensor, table: np.ndarray, length: int, group: int) -> torch.Tensor:
    """(heads, length, head_dim): a sequence's first `length` positions, each kv head repeated per query head."""
    positions = torch.arange(length)
    slots = torch.from_numpy(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1)


class PromptCase:
    """One prompt of `tokens` tokens, its blocks in a random order (or in order, with in_order)."""

    def __init__(self, tokens: int, heads: tuple[int, int, int], dtype: torch.dtype, seed: int,
                 in_order: bool = False) -> None:
        num_heads, num_kv_heads, head_dim = heads
        generator = torch.Generator().manual_seed(seed)
        num_blocks = -(-tokens // BLOCK_SIZE)
        self.table = block_ids(num_blocks + 4, num_blocks, in_order, generator)
        self.k, self.v = random_caches(num_blocks + 4, num_kv_heads, head_dim, dtype, generator)
        self.q = torch.randn(tokens, num_heads, head_dim, generator=generator).to(dtype)
        self.rows = ops.PrefillRows.of(np.array([0]), np.array([tokens]), np.array([0]), self.table[None, :],
                                       BLOCK_SIZE)
        self.scale, self.group, self.tokens = head_dim ** -0.5, num_heads // num_kv_heads, tokens
        self.flops = 4 * num_heads * head_dim * tokens * (tokens + 1) / 2

    def run(self) -> torch.Tensor:
        out = torch.empty_like(self.q)
        if not ops.prefill_attention(self.q, self.k, self.v, self.rows, out, self.scale):
            raise SystemExit("prefill_attention has no fast path for these heads on this CPU")
        return out

    def reference(self, dtype: torch.dtype) -> torch.Tensor:
        k, v = (gathered(c, self.table, self.tokens, self.group).to(dtype) for c in (self.k, self.v))
        out = F.scaled_dot_product_attention(self.q.transpose(0, 1).to(dtype), k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1)


class DecodeCase:
    """`rows` decode rows of `context` positions each, over `layers` layers' caches, each row's blocks in
    a random order (or in order, with in_order)."""

    def __init__(self, rows: int, context: int, layers: int, heads: tuple[int, int, int], dtype: torch.dtype,
                 seed: int, in_order: bool = False) -> None:
        num_heads, num_kv_heads, head_dim = heads
        generator = torch.Generator().manual_seed(seed)
        blocks_per_row = -(-context // BLOCK_SIZE)
        num_blocks = rows * blocks_per_row + 4
        self.caches = [random_caches(num_blocks, num_kv_heads, head_dim, dtype, generator) for _ in range(layers)]
        self.tables = block_ids(num_blocks, rows * blocks_per_row, in_order, generator).reshape(
            rows, blocks_per_row)
        self.q = torch.randn(rows, num_heads, head_dim, generator=generator).to(dtype)
        self.rows = ops.DecodeRows.of(np.arange(rows), self.tables, np.full(rows, context), BLOCK_SIZE)
        self.scale, self.group, self.context = head_dim ** -0.5, num_heads // num_kv_heads, context

    def run(self) -> torch.Tensor:
        out = torch.empty_like(self.q)
        for k, v in self.caches:
            ops.decode_attention(self.q, k, v, self.rows, out, self.scale)
        return out  # the last layer's

    def reference(self, dtype: torch.dtype) -> torch.Tensor:
        k_cache, v_cache = self.caches[-1]
        outs = []
        for i, table in enumerate(self.tables):
            k, v = (gathered(c, table, self.context, self.group).to(dtype) for c in (k_cache, v_cache))
            outs.append(F.scaled_dot_product_attention(self.q[i:i + 1].transpose(0, 1).to(dtype), k, v,
                                                       scale=self.scale).transpose(0, 1))
        return torch.cat(outs)


def timed_ms(run: Any, min_s: float = 0.05) -> float:
    """One run's ms: the mean over as many calls as fill min_s, after one warm-up call."""
    run()
    calls, started = 0, time.perf_counter()
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_s:
            return elapsed * 1000 / calls


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if ops.kernels() is None:
        raise SystemExit("the CPU kernels do not build here")
    dtype = getattr(torch, args.dtype)
    builds: dict[str, Any] = {"this": contextlib.nullcontext}
    if args.before is not None:
        before = source_at(args.before)
        builds = {"before": lambda: ops.kernels_from(before), "this": contextlib.nullcontext}
    in_order = args.block_order == "in-order"
    cases: dict[str, Any] = {f"prompt_{n}": PromptCase(n, args.heads, dtype, seed=n, in_order=in_order)
                             for n in args.prompt_tokens}
    cases.update({f"decode_{r}x{c}": DecodeCase(r, c, args.layers, args.heads, dtype, seed=r * 7919 + c,
                                                in_order=in_order)
                  for r, c in args.decode})
    runs: dict[str, dict[str, list[float]]] = {name: {build: [] for build in builds} for name in cases}
    errors: dict[str, dict[str, float]] = {name: {} for name in cases}
    for _ in range(args.repeats):
        for name, case in cases.items():
            for build, use in builds.items():
                with use():
                    runs[name][build].append(timed_ms(case.run))
    for name, case in cases.items():
        expected = case.reference(torch.float64)
        for build, use in builds.items():
            with use():
                errors[name][build] = (case.run().double() - expected).abs().max().item()
        if dtype == torch.bfloat16:
            errors[name]["torch_sdpa"] = (case.reference(dtype).double() - expected).abs().max().item()
    report = summarize(args, cases, runs, errors)
    print_table(report, list(builds))
    print(json.dumps(report))
    return report


def summarize(args: argparse.Namespace, cases: dict[str, Any], runs: dict[str, dict[str, list[float]]],
              errors: dict[str, dict[str, float]]) -> dict[str, Any]:
    medians = {name: {build: statistics.median(values) for build, values in by_build.items()}
               for name, by_build in runs.items()}
    report: dict[str, Any] = {"dtype": args.dtype, "heads": list(args.heads), "block_size": BLOCK_SIZE,
                              "block_order": args.block_order,
                              "layers": args.layers, "threads": args.threads, "before": args.before,
                              "ms_median": medians, "ms_runs": runs, "max_error_vs_float64": errors}
    report["prompt_gflops"] = {name: {build: case.flops / ms / 1e6 for build, ms in medians[name].items()}
                               for name, case in cases.items() if isinstance(case, PromptCase)}
    if args.before is not None:
        report["before_over_this"] = {name: m["before"] / m["this"] for name, m in medians.items()}
    return report


def print_table(report: dict[str, Any], builds: list[str]) -> None:
    unit = {True: "ms a layer", False: f"ms a step ({report['layers']} layers)"}
    print(f"{report['dtype']}, heads {report['heads']}, {report['threads']} threads, blocks {report['block_order']}")
    for name, by_build in report["ms_median"].items():
        figures = ", ".join(f"{build} {by_build[build]:.3f}" for build in builds)
        ratio = f"; before / this {report['before_over_this'][name]:.2f}x" if "before_over_this" in report else ""
        errors = ", ".join(f"{k} {v:.1e}" for k, v in report["max_error_vs_float64"][name].items())
        print(f"  {name:>16}: {figures} {unit[name.startswith('prompt')]}{ratio}; max error vs float64: {errors}")


if __name__ == "__main__":
    main()
