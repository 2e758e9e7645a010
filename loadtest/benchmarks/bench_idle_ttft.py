"""What an idle engine costs a lone prompt's first token: the engine alone, no serving path.

    python -m loadtest.benchmarks.bench_idle_ttft                  # SmolLM2, the engine's dtype, ~1 minute
    python -m loadtest.benchmarks.bench_idle_ttft --model tiny --rounds 2 --idle-s 0.2

A light load (0.2 req/s) reaches an engine that has been idle for seconds: its caches hold other
processes' data by then, and its OpenMP threads sleep. Each round times one --prompt-tokens prompt
to its first token in four conditions, interleaved so that the machine's drift falls on all alike:
- `hot`: right after the previous prompt;
- `idle`: after --idle-s seconds of sleep;
- `idle_short`: after a fifth of that;
- `evicted`: right after reading a buffer of --evict-mb (the caches hold that buffer, not the
  model), with no sleep.
Prints each condition's median and its runs and, last, one JSON object.
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

CONDITIONS = ("hot", "idle", "idle_short", "evicted")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help='checkpoint, .gguf file or "tiny" (default: SmolLM2-135M-Instruct)')
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--evict-mb", type=int, default=256)
    args = p.parse_args(argv)
    for name in ("threads", "prompt_tokens", "rounds", "evict_mb"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.idle_s >= 0:
        p.error("--idle-s must be >= 0")
    return args


def first_token_ms(engine: LLMEngine, prompt: list[int], request_id: str) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while not any(chunk.token_ids for chunk in engine.step()):
        pass
    elapsed_ms = (time.perf_counter() - started) * 1000
    while engine.has_unfinished():
        engine.step()
    return elapsed_ms


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), dtype=args.dtype, num_threads=args.threads,
                                    enable_prefix_caching=False))
    torch.set_num_threads(args.threads)
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    evict = np.ones(args.evict_mb * 2**20 // 8)
    count = 0

    def timed() -> float:
        nonlocal count
        count += 1
        return first_token_ms(engine, rng.integers(1, vocab - 1, args.prompt_tokens).tolist(), f"idle-{count}")

    for _ in range(2):  # warm-up: the first prompts build kernels and page in the weights
        timed()
    runs: dict[str, list[float]] = {condition: [] for condition in CONDITIONS}
    for _ in range(args.rounds):
        runs["hot"].append(timed())
        time.sleep(args.idle_s)
        runs["idle"].append(timed())
        time.sleep(args.idle_s / 5)
        runs["idle_short"].append(timed())
        evict.sum()
        runs["evicted"].append(timed())
    medians = {condition: statistics.median(values) for condition, values in runs.items()}
    for condition in CONDITIONS:
        print(f"{condition:12s} median {medians[condition]:7.1f} ms   runs {[round(v, 1) for v in runs[condition]]}")
    report = {"model": engine.config.model, "dtype": str(engine.runner.dtype).removeprefix("torch."),
              "prompt_tokens": args.prompt_tokens, "idle_s": args.idle_s, "evict_mb": args.evict_mb,
              "ttft_median_ms": medians, "ttft_runs_ms": runs,
              "idle_over_hot": medians["idle"] / medians["hot"],
              "evicted_over_hot": medians["evicted"] / medians["hot"]}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
