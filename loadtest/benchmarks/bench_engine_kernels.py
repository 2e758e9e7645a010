"""The engine on this checkout's CPU kernels against another kernels.cpp, turn by turn in one process.

    python -m loadtest.benchmarks.bench_engine_kernels --before HEAD~1
    python -m loadtest.benchmarks.bench_engine_kernels --variant /tmp/kernels.cpp --rounds 6 --dtype float32

bench_attention times a kernel alone. A change that wins there can win much less in the engine,
where the kernel shares each step with the matmuls (docs/benchmarks.md, twentieth pass: a decode
attention 13% faster alone moved the engine's decode step by -2.6% to +2.5% over three runs).
This measures the engine.

One engine (SmolLM2-135M-Instruct unless --model), and in each round each build in turn, the
order alternating round by round so that the machine's drift falls on both alike:
1. The KV pool is cycled: mixed requests (random prompt and output lengths) run until the pool has
   handed out every block, then the prefix cache is emptied. A sequence's blocks are then
   scattered through the cache, as in a server that has run a while, not in order as a fresh
   engine lays them out.
2. The burst: --num-requests prompts of --prompt-tokens random tokens at once, --output-tokens
   out, greedy, EOS ignored. Its wall time, output tokens/s, and the median of its decode-only
   steps (every request past its first token).
3. The batch-1 decode step: one request alone, the median over its decode steps.

The ratios are given twice: of the two builds' medians, and the median of each round's ratio (the
two turns of a round ran back to back, so that one moves least with the machine's drift). Each
build's burst outputs are compared with this checkout's, request by request: a variant that
only moves memory traffic gives the same tokens; one that changes rounding may not, and the count
says so. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.benchmarks.bench_attention import source_at
from loadtest.benchmarks.bench_engine import greedy_params
from loadtest.engine_driver import decode_steps_alone

# The mixed requests that cycle the KV pool: prompt and output lengths drawn uniformly.
CYCLE_PROMPT_TOKENS = (16, 700)
CYCLE_OUTPUT_TOKENS = (1, 48)
CYCLE_REQUESTS = 96


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    other = p.add_mutually_exclusive_group(required=True)
    other.add_argument("--before", default=None, help="a git revision whose kernels.cpp runs beside this checkout's")
    other.add_argument("--variant", type=Path, default=None, help="a kernels.cpp file that runs beside this checkout's")
    p.add_argument("--model", default=None, help="checkpoint, .gguf file or 'tiny' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or auto")
    p.add_argument("--threads", type=int, default=None, help="the engine's threads (default: its own)")
    p.add_argument("--engine-args", type=json.loads, default={},
                   help='more EngineConfig fields as a JSON object, e.g. \'{"num_kv_blocks": 4096}\'')
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rounds", "num_requests", "prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_tokens < 2:
        p.error("--output-tokens must be at least 2 (a decode step needs a first token before it)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if not isinstance(args.engine_args, dict):
        p.error("--engine-args takes a JSON object")
    if args.variant is not None and not args.variant.is_file():
        p.error(f"--variant {args.variant}: no such file")
    return args


def kv_pool(engine: Any) -> Any:
    """The engine's KV block pool (its scheduler's)."""
    return engine.scheduler.kv.pool


def drain(engine: Any) -> None:
    while engine.has_unfinished():
        engine.step()


def cycle_pool(engine: Any, pool: np.ndarray, rng: np.random.Generator) -> None:
    """Mixed requests until every block of the pool has been handed out (and taken back), then an
    empty prefix cache: the blocks a burst gets next are scattered, as a busy server leaves them."""
    blocks = kv_pool(engine)
    rounds = 0
    while rounds == 0 or len(blocks.blocks) < blocks.num_blocks:
        for i in range(CYCLE_REQUESTS):
            prompt = rng.choice(pool, size=int(rng.integers(*CYCLE_PROMPT_TOKENS, endpoint=True)))
            engine.add_request(f"cycle-{rounds}-{i}", [int(t) for t in prompt],
                               greedy_params(int(rng.integers(*CYCLE_OUTPUT_TOKENS, endpoint=True))))
        drain(engine)
        rounds += 1
        if rounds > 50:
            raise RuntimeError("the KV pool did not cycle in 50 rounds of mixed requests")
    engine.reset_prefix_cache()


def run_burst(engine: Any, burst: list[list[int]], output_tokens: int) -> dict[str, Any]:
    """Every prompt at once: wall seconds, output tokens/s, the median decode-only step (ms) and
    each request's tokens."""
    tokens: dict[str, list[int]] = {f"burst-{i}": [] for i in range(len(burst))}
    for request_id, prompt in zip(tokens, burst):
        engine.add_request(request_id, prompt, greedy_params(output_tokens))
    decode_steps: list[float] = []
    started = time.perf_counter()
    while engine.has_unfinished():
        decoding = all(tokens.values())
        step_started = time.perf_counter()
        outputs = engine.step()
        if decoding:
            decode_steps.append(time.perf_counter() - step_started)
        for out in outputs:
            tokens[out.request_id].extend(out.token_ids)
    wall = time.perf_counter() - started
    produced = sum(len(t) for t in tokens.values())
    if produced != output_tokens * len(burst):
        raise RuntimeError(f"the burst produced {produced} tokens instead of {output_tokens * len(burst)}")
    return {"wall_s": wall, "tokens_per_s": produced / wall,
            "decode_step_ms": statistics.median(decode_steps) * 1000 if decode_steps else float("nan"),
            "tokens": tokens}


def batch1_step_ms(engine: Any, prompt: list[int], output_tokens: int) -> float:
    """One request alone: the median of its decode steps (its prompt steps not counted)."""
    return statistics.median(decode_steps_alone(engine, "alone", prompt, greedy_params(output_tokens))) * 1000


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from loadtest.bench_cli import token_pool
    from model_worker import EngineConfig, LLMEngine
    from model_worker.runner.cpu_kernels import ops

    args = parse_args(argv)
    if ops.kernels() is None:
        raise SystemExit("the CPU kernels do not build here")
    other_name = "before" if args.before is not None else "variant"
    source = source_at(args.before) if args.before is not None else args.variant.read_bytes()
    try:  # the other build's errors now, before the engine loads
        with ops.kernels_from(source):
            pass
    except ops.KernelBuildError as exc:
        raise SystemExit(f"the {other_name} kernels.cpp: {exc}") from None
    builds = {"this": contextlib.nullcontext, other_name: lambda: ops.kernels_from(source)}

    pool = token_pool(args.model)
    rng = np.random.default_rng(args.seed)
    burst = [[int(t) for t in rng.choice(pool, size=args.prompt_tokens)] for _ in range(args.num_requests)]
    alone = [int(t) for t in rng.choice(pool, size=args.prompt_tokens)]
    engine_args: dict[str, Any] = {"dtype": args.dtype}
    if args.threads is not None:
        engine_args["num_threads"] = args.threads
    engine_args.update(args.engine_args)
    engine = LLMEngine(EngineConfig(model=args.model, **engine_args))
    engine.add_request("warm", alone[::-1], greedy_params(8))
    drain(engine)

    runs: dict[str, dict[str, list[float]]] = {name: {"wall_s": [], "tokens_per_s": [], "decode_step_ms": [],
                                                      "batch1_step_ms": []} for name in builds}
    outputs: dict[str, dict[str, list[int]]] = {}
    for round_index in range(args.rounds):
        order = list(builds) if round_index % 2 == 0 else list(reversed(builds))
        for name in order:
            cycle_pool(engine, pool, rng)
            with builds[name]():
                burst_figures = run_burst(engine, burst, args.output_tokens)
                engine.reset_prefix_cache()
                step = batch1_step_ms(engine, alone, args.output_tokens)
            outputs.setdefault(name, burst_figures.pop("tokens"))
            for key, value in burst_figures.items():
                runs[name][key].append(value)
            runs[name]["batch1_step_ms"].append(step)
            print(f"round {round_index + 1}, {name}: burst {burst_figures['wall_s']:.2f} s "
                  f"({burst_figures['tokens_per_s']:.1f} tok/s), decode step {burst_figures['decode_step_ms']:.2f} ms, "
                  f"batch-1 step {step:.2f} ms", flush=True)
    report = summarize(args, other_name, runs, outputs)
    print_table(report)
    print(json.dumps(report))
    return report


def summarize(args: argparse.Namespace, other_name: str, runs: dict[str, dict[str, list[float]]],
              outputs: dict[str, dict[str, list[int]]]) -> dict[str, Any]:
    medians = {name: {key: statistics.median(values) for key, values in figures.items()}
               for name, figures in runs.items()}
    return {
        "model": args.model, "dtype": args.dtype, "threads": args.threads, "engine_args": args.engine_args,
        "rounds": args.rounds,
        "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "other": other_name, "before": args.before, "variant": str(args.variant) if args.variant else None,
        "median": medians, "runs": runs,
        "other_over_this": {key: medians[other_name][key] / medians["this"][key] for key in medians["this"]},
        # Within each round the two turns ran back to back: the median of those ratios is the
        # figure least moved by the machine drifting between rounds.
        "other_over_this_paired": {key: statistics.median(theirs / ours for theirs, ours in
                                                          zip(runs[other_name][key], runs["this"][key]))
                                   for key in runs["this"]},
        "identical_requests": sum(outputs[other_name][rid] == tokens for rid, tokens in outputs["this"].items()),
    }


def print_table(report: dict[str, Any]) -> None:
    other = report["other"]
    print(f"{report['dtype']}, {report['num_requests']} x {report['prompt_tokens']} tokens in, "
          f"{report['output_tokens']} out, KV pool cycled, {report['rounds']} rounds (medians)")
    units = {"wall_s": "s", "tokens_per_s": "tok/s", "decode_step_ms": "ms", "batch1_step_ms": "ms"}
    for key, unit in units.items():
        this, theirs = report["median"]["this"][key], report["median"][other][key]
        print(f"  {key:>15}: this {this:.3f} {unit}, {other} {theirs:.3f} {unit}, {other} / this "
              f"{report['other_over_this'][key]:.3f} (round by round, median {report['other_over_this_paired'][key]:.3f})")
    print(f"  burst outputs identical to this build's: {report['identical_requests']} of {report['num_requests']}")


if __name__ == "__main__":
    main()
