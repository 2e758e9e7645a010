"""What each sampling feature costs a decode step: the engine alone, on the real model.

    python -m loadtest.benchmarks.bench_sampling_features                  # batch 1 and 32, 3 rounds
    python -m loadtest.benchmarks.bench_sampling_features --batch-sizes 1,8,32 --rounds 5

One engine serves every variant in turn, the order rotated each round, so that the machine's drift
falls on all of them alike. A variant is a batch of B requests (random 128-token prompts, EOS
ignored) that all use the same features:

- `none`: greedy, nothing else (the hot path every request takes);
- `logprobs`: greedy with logprobs of the token and its top 5 (SamplingParams.logprobs = 5);
- `penalties`: greedy with presence, frequency and repetition penalties;
- `bias_min_tokens`: greedy with a 16-entry logit_bias and min_tokens;
- `sampled`: temperature 0.8 (the fused kernel's path), for scale;
- `json_schema`: greedy under a JSON-schema grammar (an array of at least 64 integers), its mask
  filled and applied every step.

Each turn waits until every request of the batch is decoding, then times `--steps` decode steps
(engine.step(), outputs included). The figure is the median step; the ratio is each variant's
median over `none`'s, medians over the rounds. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from contracts.sampling import SamplingParams, StructuredOutput
from model_worker.runner.cpu_features import cpu_flags

VARIANTS = {
    "none": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "bias_min_tokens": {"logit_bias": {i: 1.0 for i in range(100, 116)}, "min_tokens": 10_000},
    "sampled": {"temperature": 0.8, "seed": 1},
    # At least 64 integers: a grammar the answer cannot complete within the timed steps.
    "json_schema": {"structured": StructuredOutput("json", json.dumps(
        {"type": "array", "items": {"type": "integer"}, "minItems": 64}))},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help='checkpoint dir, .gguf file or "tiny" (default: SmolLM2)')
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "none" not in args.variants:
        parser.error(f"--variants: each of {', '.join(VARIANTS)}, 'none' among them; got {unknown or args.variants}")
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.rounds < 1 or args.prompt_tokens < 1:
        parser.error("batch sizes, --steps, --rounds and --prompt-tokens must be >= 1")
    return args


def params_for(variant: str, max_tokens: int) -> SamplingParams:
    features = dict(VARIANTS[variant])
    if "min_tokens" in features:
        features["min_tokens"] = min(features["min_tokens"], max_tokens)
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": max_tokens, **features})


def turn(engine, variant: str, batch: int, steps: int, prompt_tokens: int, rng: np.random.Generator,
         tag: str) -> float:
    """The median decode step (seconds) of `batch` requests of this variant, all decoding."""
    max_tokens = steps + 4
    for i in range(batch):
        prompt = rng.integers(100, engine.vocab_size - 100, prompt_tokens).tolist()
        engine.add_request(f"{tag}-{i}", prompt, params_for(variant, max_tokens))
    decoding: set[str] = set()
    while len(decoding) < batch:  # the prompts' steps, untimed
        decoding.update(out.request_id for out in engine.step() if out.token_ids)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - started)
        if any(out.finished for out in outputs):
            break  # the batch shrinks from here (a grammar completed): time no more of it
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    max_num_seqs=max(args.batch_sizes), seed=0))
    rng = np.random.default_rng(0)
    turn(engine, "none", min(args.batch_sizes), 4, args.prompt_tokens, rng, "warm")
    seconds: dict[tuple[str, int], list[float]] = {(v, b): [] for v in args.variants for b in args.batch_sizes}
    for round_index in range(args.rounds):
        shift = round_index % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            for batch in args.batch_sizes:
                step_s = turn(engine, variant, batch, args.steps, args.prompt_tokens, rng,
                              f"r{round_index}-{variant}-{batch}")
                seconds[variant, batch].append(step_s)
                print(f"round {round_index + 1} {variant:>16} batch {batch:>3}: {step_s * 1e3:7.2f} ms",
                      file=sys.stderr)
    rows = {}
    for batch in args.batch_sizes:
        base = statistics.median(seconds["none", batch])
        for variant in args.variants:
            median = statistics.median(seconds[variant, batch])
            rows[f"{variant}@{batch}"] = {"step_ms": round(median * 1e3, 3), "over_none": round(median / base, 3),
                                          "rounds_ms": [round(s * 1e3, 3) for s in seconds[variant, batch]]}
    print(f"{'variant':>16} " + " ".join(f"{'batch ' + str(b):>18}" for b in args.batch_sizes))
    for variant in args.variants:
        cells = [rows[f"{variant}@{b}"] for b in args.batch_sizes]
        print(f"{variant:>16} " + " ".join(f"{c['step_ms']:9.2f} ms {c['over_none']:5.2f}x" for c in cells))
    result = {"model": args.model or "SmolLM2-135M-Instruct", "dtype": str(engine.runner.dtype).replace("torch.", ""),
              "threads": args.threads, "steps": args.steps, "rounds": args.rounds, "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_tile"}),
              "variants": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
