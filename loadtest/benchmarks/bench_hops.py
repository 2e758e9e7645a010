"""Where a lone request's first token waits: the same prompt timed at each layer of the serving path.

    python -m loadtest.benchmarks.bench_hops                          # SmolLM2, the engine's dtype, ~3 minutes
    python -m loadtest.benchmarks.bench_hops --prompt-tokens 4 --requests 5

One request at a time, --gap-s apart (the engine idle in between, as under a light load), each a
prompt of random tokens with one output token, timed to its first token:
- `engine`: LLMEngine.step() in this process;
- `engine_process`: AsyncLLMEngine with its engine loop in a process of its own (the pipe, the
  reader threads and the output conversion the replica runs);
- then `iterserve`'s Serve application with one replica on a local Ray (Serve's proxy path, as
  `iterserve serve` runs), called from this process: `replica` through a handle to the LLMServer
  deployment (`replica_admission`: its first chunk, the one that confirms admission), `ingress`
  through a handle to the OpenAI ingress, and `http` over HTTP through Serve's proxy;
- and `engine_serve_idle`: the first engine again while Serve runs beside it, idle: what the
  processes of Ray and Serve take from an engine on the same cores when nothing is served.
The served layers are interleaved, round by round, so that the machine's drift falls on all alike.
Prints each layer's median per prompt size and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from loadtest.local_serve import start_local_serve, stop_local_serve
from model_worker import EngineConfig, LLMEngine, SamplingParams, resolve_model

LAYERS = ("engine", "engine_process", "replica_admission", "replica", "ingress", "http", "engine_serve_idle")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help='checkpoint, .gguf file or "tiny" (default: SmolLM2-135M-Instruct)')
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", default="4,256", help="comma-separated prompt sizes")
    p.add_argument("--requests", type=int, default=10, help="requests per layer, prompt size and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gap-s", type=float, default=0.3, help="idle time before each request")
    args = p.parse_args(argv)
    try:
        args.prompt_tokens = [int(n) for n in args.prompt_tokens.split(",")]
    except ValueError:
        p.error(f"--prompt-tokens must be comma-separated integers, got {args.prompt_tokens!r}")
    if not args.prompt_tokens or min(args.prompt_tokens) < 1:
        p.error("--prompt-tokens must be at least 1 each")
    for name in ("requests", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if not args.gap_s >= 0:
        p.error("--gap-s must be >= 0")
    return args


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def engine_ms(engine: LLMEngine, prompt: list[int], request_id: str) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, _params())
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - started) * 1000


async def first_token_ms(chunks: Any, has_token: Callable[[Any], bool]) -> tuple[float, float]:
    """(ms to the first chunk, ms to the first chunk with a token) of an async stream."""
    started = time.perf_counter()
    first = token = None
    async for chunk in chunks:
        now = (time.perf_counter() - started) * 1000
        first = now if first is None else first
        if token is None and has_token(chunk):
            token = now
    if token is None:
        raise RuntimeError("the stream ended without a token")
    return first, token


def carries_token(chunk: dict[str, Any]) -> bool:
    """Whether an OpenAI completion chunk carries the request's token: its text, or (a token whose
    text is held back, as an incomplete UTF-8 sequence is) the finish reason of the one-token request."""
    choices = chunk.get("choices") or []
    return bool(choices) and bool(choices[0].get("text") or choices[0].get("finish_reason"))


async def timed_runs(run: Callable[[], Awaitable[float]], count: int, gap_s: float) -> list[float]:
    out = []
    for _ in range(count):
        await asyncio.sleep(gap_s)
        out.append(await run())
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = resolve_model(args.model)
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, enable_prefix_caching=False))
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    count = 0

    def prompt(size: int) -> list[int]:
        return rng.integers(1, vocab - 1, size).tolist()

    def next_id() -> str:
        nonlocal count
        count += 1
        return f"hops-{count}"

    runs: dict[int, dict[str, list[float]]] = {size: {layer: [] for layer in LAYERS} for size in args.prompt_tokens}

    def offline(layer: str) -> None:
        for size in args.prompt_tokens:
            for _ in range(args.requests):
                time.sleep(args.gap_s)
                runs[size][layer].append(engine_ms(engine, prompt(size), next_id()))

    for size in args.prompt_tokens:  # warm-up: kernels built, weights paged in
        engine_ms(engine, prompt(size), next_id())
    offline("engine")
    asyncio.run(_engine_process(args, model, prompt, runs))
    _served(args, model, prompt, runs, while_up=lambda: offline("engine_serve_idle"))
    medians = {size: {layer: statistics.median(values) for layer, values in layers.items() if values}
               for size, layers in runs.items()}
    print(f"{'prompt tokens':>14s} " + " ".join(f"{layer:>17s}" for layer in LAYERS))
    for size, layers in medians.items():
        print(f"{size:14d} " + " ".join(f"{layers.get(layer, float('nan')):17.1f}" for layer in LAYERS))
    report = {"model": engine.config.model, "dtype": str(engine.runner.dtype).removeprefix("torch."),
              "gap_s": args.gap_s, "first_token_median_ms": medians, "first_token_runs_ms": runs,
              "http_minus_engine_ms": {size: m["http"] - m["engine"] for size, m in medians.items()}}
    print(json.dumps(report))
    return report


async def _engine_process(args: argparse.Namespace, model: str, prompt: Callable[[int], list[int]],
                          runs: dict[int, dict[str, list[float]]]) -> None:
    from model_worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=model, dtype=args.dtype, enable_prefix_caching=False,
                                         engine_process=True))
    try:
        for size in args.prompt_tokens:
            await first_token_ms(engine.generate(prompt(size), _params()), lambda c: bool(c.token_ids))
            runs[size]["engine_process"] = await timed_runs(
                lambda: _token(engine.generate(prompt(size), _params())), args.requests, args.gap_s)
    finally:
        engine.shutdown()


async def _token(chunks: Any) -> float:
    return (await first_token_ms(chunks, lambda c: bool(c.token_ids)))[1]


def _served(args: argparse.Namespace, model: str, prompt: Callable[[int], list[int]],
            runs: dict[int, dict[str, list[float]]], while_up: Callable[[], None]) -> None:
    """The served layers' runs, then `while_up()` with Serve still running."""
    import httpx
    from ray import serve

    from contracts.serving import GenerateRequest
    from deployments.app import build_app
    from model_worker.checkpoints.models import served_name

    base = start_local_serve(serving_path="proxy")
    try:
        serve.run(build_app({"model": model, "engine_args": {"dtype": args.dtype, "enable_prefix_caching": False},
                             "num_replicas": 1}), name="iterserve", route_prefix="/")
        name = served_name(model)
        ingress = serve.get_app_handle("iterserve").options(stream=True)
        replica = serve.get_deployment_handle("LLMServer", app_name="iterserve").options(stream=True)

        def body(size: int) -> dict[str, Any]:
            return {"model": name, "prompt": prompt(size), "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                    "stream": True}

        async def via_replica(size: int) -> tuple[float, float]:
            return await first_token_ms(replica.generate_stream.remote(GenerateRequest(prompt(size), _params())),
                                        lambda c: bool(c.token_ids))

        async def via_ingress(size: int) -> float:
            return (await first_token_ms(ingress.completions_stream.remote(body(size)), carries_token))[1]

        async def via_http(client: httpx.AsyncClient, size: int) -> float:
            started = time.perf_counter()
            async with client.stream("POST", f"{base}/v1/completions", json=body(size)) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and carries_token(json.loads(line[6:])):
                        return (time.perf_counter() - started) * 1000
            raise RuntimeError("the HTTP stream ended without a token")

        async def rounds() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                for size in args.prompt_tokens:  # warm-up
                    await via_http(client, size)
                for _ in range(args.rounds):
                    for size in args.prompt_tokens:
                        for _ in range(args.requests):
                            await asyncio.sleep(args.gap_s)
                            admission, token = await via_replica(size)
                            runs[size]["replica_admission"].append(admission)
                            runs[size]["replica"].append(token)
                        runs[size]["ingress"] += await timed_runs(lambda: via_ingress(size), args.requests, args.gap_s)
                        runs[size]["http"] += await timed_runs(lambda: via_http(client, size), args.requests,
                                                               args.gap_s)

        asyncio.run(rounds())
        while_up()
    finally:
        stop_local_serve()


if __name__ == "__main__":
    main()
