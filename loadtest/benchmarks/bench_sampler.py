"""What drawing one token per row costs, by sampler path: a batch of rows of logits of a real
vocabulary, sampled at a temperature as the OpenAI API's defaults ask (temperature 1, no top-k or
top-p), through the torch ops and through our one-pass CPU kernel (cpu_kernels ops.sample), and
greedily through the argmax kernel, side by side in one run.

    python -m loadtest.benchmarks.bench_sampler                     # 64 and 1 rows of 49,152 (SmolLM2's vocabulary)
    python -m loadtest.benchmarks.bench_sampler --rows 1,8,64,256 --vocab 128256

Prints a table and, last, one JSON object: milliseconds per call (median of --repeats timings of
--calls calls each) by dtype, rows and path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from contracts.sampling import SamplingParams
from model_worker.runner.cpu_kernels import ops
from model_worker.runner.sampler import Sampler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if any(r < 1 for r in args.rows) or args.vocab < 1 or set(args.dtypes) - set(DTYPES):
        p.error("rows and vocab must be >= 1, dtypes among " + ", ".join(DTYPES))
    return args


def time_ms(call: Callable[[], object], calls: int, repeats: int) -> float:
    call()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        timings.append((time.perf_counter() - started) / calls * 1000)
    return statistics.median(timings)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if ops.kernels() is None:
        raise SystemExit("the CPU kernels do not build here: nothing to compare")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'dtype':9} {'rows':>5} {'torch ms':>9} {'one pass ms':>12} {'argmax ms':>10}")
    for dtype_name in args.dtypes:
        for rows in args.rows:
            logits = (torch.randn(rows, args.vocab, generator=generator) * 3).to(DTYPES[dtype_name])
            sampler = Sampler(torch.device("cpu"), seed=0)
            params, indices = [SamplingParams(temperature=1.0)] * rows, [0] * rows
            figures = {
                "torch": time_ms(lambda: sampler._torch_sample(logits, params, indices), args.calls, args.repeats),
                "one_pass": time_ms(lambda: sampler.sample(logits, params, indices), args.calls, args.repeats),
                "argmax": time_ms(lambda: ops.argmax(logits), args.calls, args.repeats),
            }
            results.setdefault(dtype_name, {})[str(rows)] = figures
            print(f"{dtype_name:9} {rows:>5} {figures['torch']:>9.2f} {figures['one_pass']:>12.2f} {figures['argmax']:>10.2f}")
    report = {"vocab": args.vocab, "threads": args.threads, "ms_per_call": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
