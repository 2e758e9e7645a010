"""Prefill and decode speed of our engine per dtype: what one step costs, not a workload.

    python -m loadtest.benchmarks.bench_step_speed                          # SmolLM2, float32 and bfloat16, ~3 minutes
    python -m loadtest.benchmarks.bench_step_speed --model tiny --dtypes float32

For each dtype: prefill throughput of one --prefill-tokens prompt in a single step (prefix caching
off, median of --repeats), and the median decode step at each --batch-sizes (that many requests
past their prefill, one token each per step). Also a 1024x1024 matmul probe per dtype, which says
whether this CPU computes that dtype natively. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from model_worker import EngineConfig, LLMEngine, SamplingParams, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help='checkpoint, .gguf file or "tiny" (default: SmolLM2-135M-Instruct)')
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes takes a comma-separated subset of {','.join(DTYPES)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def matmul_gflops(dtype: torch.dtype, seconds: float = 0.5) -> float:
    a = torch.randn(1024, 1024).to(dtype)
    a @ a
    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ a
        reps += 1
    return reps * 2 * 1024**3 / (time.perf_counter() - start) / 1e9


def prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=(count, length)).tolist()


def timed_step(engine: LLMEngine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def prefill_tokens_per_s(engine: LLMEngine, args: argparse.Namespace) -> float:
    times = []
    for i, prompt in enumerate(prompts(engine.vocab_size, args.repeats + 1, args.prefill_tokens, seed=1)):
        engine.add_request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        times.append(timed_step(engine))  # the whole prompt in one step: the budget is its length
        while engine.has_unfinished():
            engine.step()
    return args.prefill_tokens / statistics.median(times[1:])  # the first warms the kernels up


def decode_step_s(engine: LLMEngine, batch: int, args: argparse.Namespace) -> float:
    params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts(engine.vocab_size, batch, 32, seed=batch)):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    engine.step()  # every prompt in one step (the token budget holds them all), then decodes only
    if engine.stats().num_waiting:
        raise RuntimeError(f"batch {batch} did not fit one prefill step")
    engine.step()  # warm-up decode
    times = [timed_step(engine) for _ in range(args.decode_steps)]
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def measure(path: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, num_threads=args.threads, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(args.prefill_tokens, max(args.batch_sizes) * 32),
                                    max_num_seqs=max(args.batch_sizes)))
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"matmul_gflops": matmul_gflops(DTYPES[dtype]),
                              "prefill_tokens_per_s": prefill_tokens_per_s(engine, args)}
    for batch in args.batch_sizes:
        step_s = decode_step_s(engine, batch, args)
        result[f"decode_step_ms_batch_{batch}"] = step_s * 1000
        result[f"decode_tokens_per_s_batch_{batch}"] = batch / step_s
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    path = resolve_model(args.model)
    results = {dtype: measure(path, dtype, args) for dtype in args.dtypes}
    keys = list(next(iter(results.values())))
    print(f"{'':32s}" + "".join(f"{d:>12s}" for d in results))
    for key in keys:
        print(f"{key:32s}" + "".join(f"{r[key]:12.1f}" for r in results.values()))
    report = {"model": path, "threads": args.threads, "prefill_tokens": args.prefill_tokens, "by_dtype": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
