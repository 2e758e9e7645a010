"""The `iterserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from contracts.sampling import SamplingParams
from model_worker.config import EngineConfig

DEMO_PROMPTS = [
    "The scheduler decides the batch again before every step, so",
    "A paged KV cache splits each sequence into fixed-size blocks;",
    "Short requests never wait for long ones because",
    "Prefix caching reuses the blocks of a shared system prompt:",
    "When the cache runs out of blocks, the latest request",
    "Continuous batching",
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["simulate", "profile"]:  # a command of its own under simulate: measure and fit a step-time profile
        from simulator import step_model
        return step_model.main(argv[2:])
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offline generation demo: stream completions of a few prompts at once")
    demo.add_argument("--model", default=None, help='checkpoint directory, hub id, .gguf file, or "tiny" (default: SmolLM2-135M-Instruct)')
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--temperature", type=float, default=0.8)
    demo.add_argument("--seed", type=int, default=0)
    generate = sub.add_parser("generate", help="complete one prompt and stream it to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    from iterserve import serve_cli
    from loadtest import bench_cli
    from simulator import cli as sim_cli
    serve_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    sim_cli.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return serve_cli.run(args)
        if args.command == "bench":
            return bench_cli.run(args)
        if args.command == "simulate":
            return sim_cli.run(args)
        if args.command == "demo":
            return asyncio.run(_demo(args))
        return asyncio.run(_generate(args))
    except ValueError as exc:
        print(f"iterserve: error: {exc}", file=sys.stderr)
        return 2


async def _demo(args: argparse.Namespace) -> int:
    from model_worker.engine.async_engine import AsyncLLMEngine

    print("iterserve demo: loading the model (the first use converts the embedded SmolLM2 once)...", flush=True)
    start_s = time.monotonic()
    engine = AsyncLLMEngine(EngineConfig(model=args.model))
    print(f"loaded in {time.monotonic() - start_s:.1f}s; streaming {len(DEMO_PROMPTS)} requests batched together\n")
    try:
        texts = [""] * len(DEMO_PROMPTS)

        async def run(index: int, prompt: str) -> None:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed + index)
            async for out in engine.generate(prompt, params, request_id=f"demo-{index}"):
                texts[index] += out.text
                if out.text:
                    print(f"[{index}] +{out.text!r}", flush=True)
                if out.finished:
                    ttft = out.timings.ttft_s if out.timings else float("nan")
                    print(f"[{index}] finished ({out.finish_reason}, {out.num_output_tokens} tokens, "
                          f"TTFT {ttft * 1000:.0f} ms)", flush=True)

        await asyncio.gather(*(run(i, p) for i, p in enumerate(DEMO_PROMPTS)))
        print("\ncompletions:")
        for prompt, text in zip(DEMO_PROMPTS, texts):
            print(f"- {prompt!r} -> {text!r}")
        stats = await engine.stats()
        print(f"\nsteps: {stats.num_steps}, generated tokens: {stats.generation_tokens_total}, "
              f"KV blocks free: {stats.num_free_kv_blocks}/{stats.num_total_kv_blocks}")
    finally:
        engine.shutdown()
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from model_worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=args.model))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        async for out in engine.generate(args.prompt, params):
            print(out.text, end="", flush=True)
        print()
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
