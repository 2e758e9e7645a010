"""Greedy agreement across dtypes: our engine in float32 and bfloat16 against transformers'
`generate` in float32 and bfloat16, on natural-language chat prompts of a real model.

    python -m loadtest.benchmarks.bench_agreement                 # SmolLM2, 20 chat prompts, ~6 minutes on 2 cores
    python -m loadtest.benchmarks.bench_agreement --no-ablation   # without the float32-island ablation

transformers runs each prompt alone; our engine runs all of them batched, with chunked prefill and
prefix caching. Every output is greedy, up to --max-tokens or the checkpoint's EOS. For each
system and each reference it reports the share of outputs identical token for token, and for the
others the mean position of the first differing token. The ablation runs our bfloat16 engine with
no float32 islands, each island alone, and all of them (model_worker/runner/llama.py,
LlamaDecoder). Prints a table and, as its last stdout line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from loadtest.benchmarks.chat_prompts import CHAT_PROMPTS, render
from model_worker import EngineConfig, LLMEngine, SamplingParams, resolve_model

from model_worker.runner.llama import ISLANDS

REFERENCES = ("hf_float32", "hf_bfloat16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help='checkpoint, .gguf file or "tiny" (default: SmolLM2-135M-Instruct)')
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-ablation", action="store_true", help="only our float32 and full bfloat16 engines")
    return p.parse_args(argv)


def hf_outputs(path: str, dtype: torch.dtype, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    started_s = time.perf_counter()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs, time.perf_counter() - started_s


def engine_outputs(path: str, dtype: str, prompts: list[list[int]], max_tokens: int, threads: int,
                   islands: dict[str, bool] | None = None) -> tuple[list[list[int]], float, float]:
    """(outputs, seconds for all of them batched, median seconds of a batch-1 decode step)."""
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, num_threads=threads, enable_prefix_caching=True))
    if islands is not None:
        engine.runner.model.set_islands(**islands)
    started_s = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    seconds = time.perf_counter() - started_s
    return [tokens[str(i)] for i in range(len(prompts))], seconds, batch_1_step_s(engine, prompts[0])


def batch_1_step_s(engine: LLMEngine, prompt: list[int], steps: int = 16) -> float:
    """What this configuration's islands cost a step: the median decode step of one request."""
    engine.add_request("timed", prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    times = []
    while engine.has_unfinished():
        started_s = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started_s)
    return statistics.median(times)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Share of identical outputs, and the mean first differing position of the others."""
    firsts = []
    for ours, theirs in zip(outputs, reference):
        if ours != theirs:
            firsts.append(next(k for k, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b))
    return {"identical": len(outputs) - len(firsts), "total": len(outputs),
            "share_identical": (len(outputs) - len(firsts)) / len(outputs),
            "mean_first_divergence": sum(firsts) / len(firsts) if firsts else None}


def engine_systems(ablation: bool) -> dict[str, tuple[str, dict[str, bool] | None]]:
    systems: dict[str, tuple[str, dict[str, bool] | None]] = {"ours_float32": ("float32", None)}
    if ablation:
        systems["ours_bfloat16_no_islands"] = ("bfloat16", dict.fromkeys(ISLANDS, False))
        for island in ISLANDS:
            systems[f"ours_bfloat16_only_{island}"] = ("bfloat16", {name: name == island for name in ISLANDS})
        systems["ours_bfloat16_every_island"] = ("bfloat16", dict.fromkeys(ISLANDS, True))
    systems["ours_bfloat16"] = ("bfloat16", None)  # the decoder's defaults
    return systems


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    from model_worker.checkpoints.models import load_tokenizer

    tokenizer = load_tokenizer(path)
    prompts = [render(tokenizer, conversation) for conversation in CHAT_PROMPTS]
    print(f"{len(prompts)} chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"greedy up to {args.max_tokens} tokens or EOS, {args.threads} threads", file=sys.stderr)
    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    step_ms: dict[str, float] = {}
    for name, dtype in (("hf_float32", torch.float32), ("hf_bfloat16", torch.bfloat16)):
        outputs[name], seconds[name] = hf_outputs(path, dtype, prompts, args.max_tokens)
        print(f"{name}: {seconds[name]:.1f}s", file=sys.stderr)
    for name, (dtype, islands) in engine_systems(not args.no_ablation).items():
        outputs[name], seconds[name], step_s = engine_outputs(path, dtype, prompts, args.max_tokens, args.threads,
                                                              islands)
        step_ms[name] = step_s * 1000
        print(f"{name}: {seconds[name]:.1f}s, batch-1 decode step {step_ms[name]:.1f} ms", file=sys.stderr)
    results = {name: {ref: agreement(outs, outputs[ref]) for ref in REFERENCES if ref != name}
               for name, outs in outputs.items()}
    print(format_table(results, step_ms))
    summary = {"model": path, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
               "mean_output_tokens": {name: sum(map(len, outs)) / len(outs) for name, outs in outputs.items()},
               "seconds": seconds, "decode_step_ms_batch_1": step_ms, "agreement": results}
    print(json.dumps(summary))
    return summary


def format_table(results: dict[str, dict[str, dict[str, float]]], step_ms: dict[str, float]) -> str:
    header = f"{'system':36s}" + "".join(f"{'vs ' + ref:>34s}" for ref in REFERENCES) + f"{'step ms':>10s}"
    lines = [header, "-" * len(header)]
    for name, by_ref in results.items():
        cells = []
        for ref in REFERENCES:
            a = by_ref.get(ref)
            if a is None:
                cells.append(f"{'(reference)':>34s}")
                continue
            first = "-" if a["mean_first_divergence"] is None else f"{a['mean_first_divergence']:.1f}"
            cells.append(f"{a['identical']:>10d}/{a['total']:<3d} same, first diff {first:>5s}")
        step = f"{step_ms[name]:10.1f}" if name in step_ms else f"{'':10s}"
        lines.append(f"{name:36s}" + "".join(cells) + step)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
