"""Where a step's time goes, per step kind: the torch profiler's per-op table of our engine's steps.

    python -m loadtest.benchmarks.profile_steps                       # SmolLM2, float32 and bfloat16
    python -m loadtest.benchmarks.profile_steps --dtypes bfloat16 --kinds decode-1,prefill-256

Step kinds: `decode-B` (B requests past a 32-token prompt, one token each), `prefill-N` (one
N-token prompt in one step, prefix caching off) and `mixed-B-N` (B running decodes and an N-token
prompt in the same step). For each dtype and kind: the median step without the profiler, then
--steps steps under it, and the ops that took the most self CPU time, per step (milliseconds and
calls), with the share of the step the listed ops leave to Python and dispatch. Prints the tables
and, last, one JSON object; docs/benchmarks.md holds the tables of a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from model_worker import EngineConfig, LLMEngine, SamplingParams, resolve_model

DTYPES = ("float32", "bfloat16")
DEFAULT_KINDS = "decode-1,decode-8,decode-32,prefill-256,mixed-4-256"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help='checkpoint, .gguf file or "tiny" (default: SmolLM2-135M-Instruct)')
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--kinds", default=DEFAULT_KINDS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="steps timed, and steps profiled, per kind")
    p.add_argument("--top", type=int, default=12, help="ops listed per kind")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes takes a comma-separated subset of {','.join(DTYPES)}")
    args.kinds = [parse_kind(k, p) for k in args.kinds.split(",") if k]
    return args


def parse_kind(text: str, parser: argparse.ArgumentParser) -> tuple[str, int, int]:
    """'decode-8' -> ('decode', 8, 0); 'prefill-256' -> ('prefill', 0, 256); 'mixed-4-256' -> ('mixed', 4, 256)."""
    name, *numbers = text.split("-")
    try:
        values = [int(n) for n in numbers]
    except ValueError:
        values = []
    shapes = {"decode": 1, "prefill": 1, "mixed": 2}
    if name not in shapes or len(values) != shapes[name] or min(values) < 1:
        parser.error(f"step kind {text!r}: use decode-B, prefill-N or mixed-B-N")
    if name == "decode":
        return name, values[0], 0
    if name == "prefill":
        return name, 0, values[0]
    return name, values[0], values[1]


class StepMaker:
    """Puts the engine in the state where its next step is of a given kind."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(0)
        self.count = 0

    def _add(self, length: int, max_tokens: int) -> None:
        prompt = self.rng.integers(100, self.engine.vocab_size - 100, size=length).tolist()
        self.engine.add_request(f"r{self.count}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                        ignore_eos=True))
        self.count += 1

    def drain(self) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)
        while self.engine.has_unfinished():
            self.engine.step()

    def decodes(self, batch: int, steps: int) -> None:
        """`batch` requests past their prompts, with `steps` decode steps left in each."""
        for _ in range(batch):
            self._add(32, steps + 4)
        self.engine.step()  # every prompt in one step
        self.engine.step()  # one warm-up decode

    def prompt(self, length: int) -> None:
        self._add(length, 1)


def run_kind(engine: LLMEngine, kind: tuple[str, int, int], args: argparse.Namespace) -> dict[str, Any]:
    name, batch, prompt_len = kind
    maker = StepMaker(engine)
    total_steps = 2 * args.steps + 1  # one warm-up, the timed steps, the profiled steps
    if name != "prefill":
        maker.decodes(batch, total_steps)

    def one_step() -> float:
        if name != "decode":
            maker.prompt(prompt_len)
        started = time.perf_counter()
        engine.step()
        return time.perf_counter() - started

    one_step()
    times = [one_step() for _ in range(args.steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = [one_step() for _ in range(args.steps)]
    maker.drain()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1000 / args.steps,
            "calls_per_step": e.count / args.steps} for e in rows[: args.top]]
    total_op_ms = sum(e.self_cpu_time_total for e in rows) / 1000 / args.steps
    return {"step_ms": statistics.median(times) * 1000, "profiled_step_ms": statistics.median(profiled) * 1000,
            "op_ms_per_step": total_op_ms,
            "op_calls_per_step": sum(e.count for e in rows) / args.steps, "top_ops": ops}


def kind_name(kind: tuple[str, int, int]) -> str:
    name, batch, prompt_len = kind
    return "-".join(str(part) for part in (name, batch or None, prompt_len or None) if part is not None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    path = resolve_model(args.model)
    largest_batch = max([batch for _, batch, _ in args.kinds] + [1])
    largest_prompt = max([length for _, _, length in args.kinds] + [32])
    report: dict[str, Any] = {"model": path, "threads": args.threads, "by_dtype": {}}
    for dtype in args.dtypes:
        engine = LLMEngine(EngineConfig(model=path, dtype=dtype, num_threads=args.threads, enable_prefix_caching=False,
                                        max_num_batched_tokens=max(512, largest_batch * 32 + largest_prompt),
                                        max_num_seqs=largest_batch + 2 * args.steps + 2))
        torch.set_num_threads(args.threads)
        results = report["by_dtype"][dtype] = {}
        for kind in args.kinds:
            result = results[kind_name(kind)] = run_kind(engine, kind, args)
            print(f"\n{dtype} {kind_name(kind)}: step {result['step_ms']:.1f} ms "
                  f"(profiled {result['profiled_step_ms']:.1f} ms; ops' own time {result['op_ms_per_step']:.1f} ms "
                  f"in {result['op_calls_per_step']:.0f} calls)")
            print(f"  {'op':40s} {'ms/step':>8s} {'calls/step':>10s}")
            for op in result["top_ops"]:
                print(f"  {op['op'][:40]:40s} {op['ms_per_step']:8.2f} {op['calls_per_step']:10.0f}")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
