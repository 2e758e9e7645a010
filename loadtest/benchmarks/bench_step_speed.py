"""Prefill and decode speed of our engine per dtype: what one step costs, not a workload.

    python -m loadtest.benchmarks.bench_step_speed                          # SmolLM2, float32 and bfloat16, ~3 minutes
    python -m loadtest.benchmarks.bench_step_speed --model tiny --dtypes float32

For each dtype: prefill throughput of one --prefill-tokens prompt in a single step (prefix caching
off, median of --repeats), and the median decode step at each --batch-sizes (that many requests
past their prefill, one token each per step), with its host time (the step less the model's
forward: schedule, prepare, sample, outputs) and that time's share of the step.

Each figure stands beside its floor, measured in the same run:
- the weight-read floor of a decode step: the bytes of every weight a step reads (each layer's
  matrices and norms, the LM head, and its float32 copy where the decoder keeps one; not the
  embedding table, of which a step reads a row per token) over the machine's read bandwidth (the
  best of several streaming reads of a buffer far past the last-level cache, on --threads
  threads); `decode_step_over_floor_batch_1` is the batch-1 step over that floor;
- `decode_step_batch_8_over_batch_1`: what seven more sequences cost a step;
- the matmul rate: a 1024x1024 matmul probe per dtype (it also says whether the CPU computes that
  dtype natively); `prefill_fraction_of_matmul` is the prefill's rate in FLOP/s (2 per weight per
  token, attention left out) over it.
Prints a table and, last, one JSON object.
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
from model_worker.runner import linear as packed_linear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help='checkpoint, .gguf file or "tiny" (default: SmolLM2-135M-Instruct)')
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,2,8,32,64")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes takes a comma-separated subset of {','.join(DTYPES)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def matmul_gflops(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """The machine's matmul rate in this dtype: the better of torch's 1024x1024 matmul and the
    same matmul through a oneDNN-packed weight (what the decoder runs, where it packs)."""
    a = torch.randn(1024, 1024).to(dtype)
    calls = [lambda: a @ a]
    if packed_linear.packs("cpu", dtype):
        weight = packed_linear.pack(a)
        calls.append(lambda: packed_linear.linear(a, weight))
    best = 0.0
    for call in calls:
        call()
        start, reps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            call()
            reps += 1
        best = max(best, reps * 2 * 1024**3 / (time.perf_counter() - start) / 1e9)
    return best


def read_gb_s(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """The machine's streaming read bandwidth: the best of `repeats` sums over a float32 buffer of
    `num_bytes`, far past any last-level cache (a sum does one add per 4 bytes read)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def decode_read_bytes(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads: every layer's tensors, the final norm and the LM
    head (and the float32 copy of the head the decoder reads instead, where it keeps one)."""
    decoder = engine.runner.model
    weights = decoder.weights
    layer_bytes = sum(tensor.nbytes for layer in weights.layers for tensor in _tensors(layer))
    head = decoder.lm_head_read_per_step()
    return layer_bytes + weights.norm.nbytes + head.nbytes


def matmul_weight_count(engine: LLMEngine) -> int:
    """Weights that take part in a matmul per token: the layers' matrices and the LM head."""
    weights = engine.runner.model.weights
    layers = sum(layer.qkv_proj.numel() + layer.o_proj.numel() + layer.gate_up_proj.numel()
                 + layer.down_proj.numel() for layer in weights.layers)
    return layers + weights.lm_head.numel()


def _tensors(layer: Any) -> list[torch.Tensor]:
    return [getattr(layer, name) for name in layer.__slots__ if isinstance(getattr(layer, name), torch.Tensor)]


def prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=(count, length)).tolist()


def timed_step(engine: LLMEngine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def timed_step_and_host(engine: LLMEngine) -> tuple[float, float]:
    """(the step's seconds, of which outside the model's forward)."""
    forward_before = engine.runner.forward_time_s
    step_s = timed_step(engine)
    return step_s, step_s - (engine.runner.forward_time_s - forward_before)


def prefill_tokens_per_s(engine: LLMEngine, args: argparse.Namespace) -> float:
    times = []
    for i, prompt in enumerate(prompts(engine.vocab_size, args.repeats + 1, args.prefill_tokens, seed=1)):
        engine.add_request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        times.append(timed_step(engine))  # the whole prompt in one step: the budget is its length
        while engine.has_unfinished():
            engine.step()
    return args.prefill_tokens / statistics.median(times[1:])  # the first warms the kernels up


def decode_step_s(engine: LLMEngine, batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """Median seconds of a decode step at `batch`, and the median host seconds of one."""
    params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts(engine.vocab_size, batch, 32, seed=batch)):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    engine.step()  # every prompt in one step (the token budget holds them all), then decodes only
    if engine.stats().num_waiting:
        raise RuntimeError(f"batch {batch} did not fit one prefill step")
    engine.step()  # warm-up decode
    times = [timed_step_and_host(engine) for _ in range(args.decode_steps)]
    while engine.has_unfinished():
        engine.step()
    return statistics.median(t for t, _ in times), statistics.median(h for _, h in times)


def measure(path: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, num_threads=args.threads, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(args.prefill_tokens, max(args.batch_sizes) * 32),
                                    max_num_seqs=max(args.batch_sizes)))
    torch.set_num_threads(args.threads)
    matmul = matmul_gflops(DTYPES[dtype])
    prefill = prefill_tokens_per_s(engine, args)
    result: dict[str, Any] = {
        "read_gb_s": read_gb_s(), "decode_read_mb": decode_read_bytes(engine) / 1e6,
        "decode_floor_ms": None, "matmul_gflops": matmul, "prefill_tokens_per_s": prefill,
        "prefill_gflops": prefill * 2 * matmul_weight_count(engine) / 1e9}
    result["prefill_fraction_of_matmul"] = result["prefill_gflops"] / matmul
    for batch in args.batch_sizes:
        step_s, host_s = decode_step_s(engine, batch, args)
        result[f"decode_step_ms_batch_{batch}"] = step_s * 1000
        result[f"decode_tokens_per_s_batch_{batch}"] = batch / step_s
        result[f"host_ms_batch_{batch}"] = host_s * 1000
        result[f"host_share_batch_{batch}"] = host_s / step_s
    if 1 in args.batch_sizes:
        result["decode_step_over_floor_batch_1"] = None  # main's, from the run's best read rate
        if 8 in args.batch_sizes:
            result["decode_step_batch_8_over_batch_1"] = (result["decode_step_ms_batch_8"]
                                                          / result["decode_step_ms_batch_1"])
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    path = resolve_model(args.model)
    first_probe = read_gb_s()
    results = {dtype: measure(path, dtype, args) for dtype in args.dtypes}
    # Every floor from the best read rate of the run: one probe alone read 34 or 61 GB/s on the same
    # 2-core AMD VM, which moved the floor 2x between dtypes when each took its own.
    best = max([first_probe, *(r["read_gb_s"] for r in results.values())])
    for result in results.values():
        result["read_gb_s"] = best
        result["decode_floor_ms"] = result["decode_read_mb"] / best  # MB / (GB/s) = ms
        if "decode_step_over_floor_batch_1" in result:
            result["decode_step_over_floor_batch_1"] = result["decode_step_ms_batch_1"] / result["decode_floor_ms"]
    keys = list(next(iter(results.values())))
    print(f"{'':34s}" + "".join(f"{d:>12s}" for d in results))
    for key in keys:
        print(f"{key:34s}" + "".join(f"{r[key]:12.3g}" for r in results.values()))
    report = {"model": path, "threads": args.threads, "prefill_tokens": args.prefill_tokens, "by_dtype": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
