"""What one engine-loop message costs to cross the pipe: msgspec structs against pickled tuples.

    python -m loadtest.benchmarks.bench_engine_protocol                    # ~20 s
    python -m loadtest.benchmarks.bench_engine_protocol --running 1,32,256 --repeats 9

For a step's output message at each --running count (every request running, one token each) and
for one add message, times, per message, in this process and without the pipe itself:
  - codec: encode + decode of the message as built;
  - hop: the whole crossing, from the step's GenerationChunks to the consumer's GenerationChunks
    (build the message, encode, decode, turn each output back into a chunk).
`tuple` is the baseline: positional tuples pickled as multiprocessing's Connection.send/recv
pickle them (ForkingPickler, its default protocol). `struct` is model_worker.engine.protocol with
its EngineCodec. Each figure is the median over --repeats runs of as many messages as fill about
--run-s seconds; tuple and struct alternate run by run, so that drift of a shared machine falls on both.
Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import GenerationChunk
from model_worker.engine.protocol import (AddRequest, EngineCodec, EngineInput, EngineOutput, RequestFinished,
                                          RequestProgress, StepOutputs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="1,32,256", help="running requests per step message")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--run-s", type=float, default=0.2, help="seconds per timed run")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the add message")
    args = p.parse_args(argv)
    args.running = [int(n) for n in args.running.split(",") if n]
    return args


def step_chunks(num_running: int) -> list[GenerationChunk]:
    """What LLMEngine.step returns with this many requests decoding (detokenize off)."""
    return [GenerationChunk(f"{i:032x}", token_ids=[1000 + i], num_prompt_tokens=256, num_output_tokens=40 + i,
                            num_cached_tokens=64) for i in range(num_running)]


# ---- the baseline: positional tuples, pickled --------------------------------------------------

def tuple_step(outputs: list[GenerationChunk]) -> tuple:
    return ("step", time.monotonic(),
            [(o.request_id, o.token_ids, o.num_output_tokens, o.num_cached_tokens)
             if not o.finished and o.error is None and not o.text else o for o in outputs])


def tuple_chunks(message: tuple) -> list[GenerationChunk]:
    chunks = []
    for item in message[2]:
        request_id, token_ids, num_output_tokens, num_cached_tokens = item
        chunks.append(GenerationChunk(request_id, token_ids=token_ids, num_prompt_tokens=256,
                                      num_output_tokens=num_output_tokens, num_cached_tokens=num_cached_tokens))
    return chunks


def pickle_encode(message: Any) -> bytes:
    return bytes(ForkingPickler.dumps(message))


def pickle_decode(data: bytes) -> Any:
    return ForkingPickler.loads(data)


# ---- the protocol -------------------------------------------------------------------------------

def struct_step(outputs: list[GenerationChunk]) -> StepOutputs:
    progress, finished = [], []
    for o in outputs:
        if o.finished:
            finished.append(RequestFinished.of(o))
        else:
            progress.append(RequestProgress(o.request_id, o.token_ids, o.num_output_tokens, o.num_cached_tokens))
    return StepOutputs(time.monotonic(), progress, finished)


def struct_chunks(message: StepOutputs) -> list[GenerationChunk]:
    return [p.to_chunk(256) for p in message.progress] + [f.to_chunk() for f in message.finished]


# ---- timing -------------------------------------------------------------------------------------

def per_call_us(fn: Callable[[], Any], run_s: float) -> Callable[[], float]:
    """A timed run of fn: microseconds per call over about run_s seconds."""
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < run_s / 4:
        fn()
        calls += 1
    count = max(calls * 4, 1)

    def run() -> float:
        began = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - began) / count * 1e6
    return run


def compare(cases: dict[str, Callable[[], Any]], repeats: int, run_s: float) -> dict[str, float]:
    runs = {name: per_call_us(fn, run_s) for name, fn in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    out_codec, in_codec = EngineCodec(EngineOutput), EngineCodec(EngineInput)
    rows = []
    for num_running in args.running:
        chunks = step_chunks(num_running)
        old, new = tuple_step(chunks), struct_step(chunks)
        old_bytes, new_bytes = pickle_encode(old), out_codec.encode(new)
        assert [c.token_ids for c in tuple_chunks(pickle_decode(old_bytes))] == \
               [c.token_ids for c in struct_chunks(out_codec.decode(new_bytes))]
        figures = compare({
            "tuple_codec": lambda: pickle_decode(pickle_encode(old)),
            "struct_codec": lambda: out_codec.decode(out_codec.encode(new)),
            "tuple_hop": lambda: tuple_chunks(pickle_decode(pickle_encode(tuple_step(chunks)))),
            "struct_hop": lambda: struct_chunks(out_codec.decode(out_codec.encode(struct_step(chunks)))),
        }, args.repeats, args.run_s)
        rows.append({"message": f"step, {num_running} running", "tuple_bytes": len(old_bytes),
                     "struct_bytes": len(new_bytes), **figures})
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    hashes = [(2**63 + 7919 * i) % 2**64 for i in range(args.prompt_tokens // 16)]
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=7, stop=["\n\n"])
    old_add = ("add", "0" * 32, prompt, params, 0, time.monotonic(), None, [], hashes)
    new_add = AddRequest("0" * 32, prompt, params, Priority.INTERACTIVE, time.monotonic(), None, [], hashes)
    codec = {"tuple_codec": lambda: pickle_decode(pickle_encode(old_add)),
             "struct_codec": lambda: in_codec.decode(in_codec.encode(new_add))}
    figures = compare(codec, args.repeats, args.run_s)
    rows.append({"message": f"add, {args.prompt_tokens} prompt tokens", "tuple_bytes": len(pickle_encode(old_add)),
                 "struct_bytes": len(in_codec.encode(new_add)), **figures,
                 "tuple_hop": None, "struct_hop": None})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    print(f"{'message':<28} {'bytes tuple/struct':>20} {'codec us tuple/struct':>24} {'hop us tuple/struct':>22}")
    for r in rows:
        hop = "" if r["tuple_hop"] is None else f"{r['tuple_hop']:.1f} / {r['struct_hop']:.1f}"
        print(f"{r['message']:<28} {r['tuple_bytes']:>9} / {r['struct_bytes']:<8} "
              f"{r['tuple_codec']:>11.1f} / {r['struct_codec']:<10.1f} {hop:>22}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
