"""The two transformers baselines: `generate` in static batches, and transformers' own continuous
batching manager. Both replay a workload (list of BenchRequest) against a wall clock and return one
RequestResult per request, times in seconds since the start of the run.

Both are fed the workload's token ids directly and generate exactly each request's output length
(EOS disabled), greedy, so they do the same work as our engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from loadtest.results import RequestResult
from loadtest.traces import BenchRequest

Clock = Callable[[], float]


@dataclass(slots=True)
class HFContinuousOptions:
    """What we pass to transformers' ContinuousBatchingConfig, tuned for the tiny model on 2 CPU
    cores (the tuning runs: docs/benchmarks.md, 'Engine: continuous vs static batching vs
    transformers'). Larger batches lose because HF's per-step mask and attention span the whole
    batch."""

    # "sdpa" or "paged|eager" are the CPU choices (flash needs CUDA). Either way HF CB builds one
    # dense (batch_tokens x (kv_read + batch_tokens)) mask per step; sdpa was faster.
    attn_implementation: str = "sdpa"
    # Tokens per page. HF's default of 256 leaves most of a page empty for short requests.
    page_size: int = 32
    # Blocks of page_size tokens (all layers): 2048 x 32 = 64k tokens, room for every running
    # request. Left at None, HF sizes the cache to 60% of the machine's RAM, which takes seconds
    # to allocate, plus an attention-mask buffer sized by the whole cache.
    num_blocks: int = 2048
    # Token budget per step (decodes + prefill chunks), as our engine's max_num_batched_tokens.
    max_batch_tokens: int = 512
    # Most requests in one step.
    max_requests_per_batch: int = 32
    # CUDA graphs and asynchronous batching: off (nothing to gain on a CPU); None lets transformers
    # decide, which is what a GPU run wants (loadtest/benchmarks/gpu_check.py).
    use_cuda_graph: bool | None = False
    use_async_batching: bool | None = False


def load_hf_model(path: str, attn_implementation: str = "sdpa", num_threads: int = 2,
                  dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


class _FirstTokenStreamer(BaseStreamer):
    """Notes when `generate` emits its first new token (its first put() is the prompt)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._puts = 0
        self.first_token_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 2:
            self.first_token_s = self._clock()

    def end(self) -> None:
        pass


def _left_padded(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def generate_static_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int,
                          clock: Clock = time.perf_counter) -> tuple[float | None, torch.Tensor]:
    """One left-padded greedy `generate` for the whole batch, max_new_tokens = the batch's longest
    output and EOS off, so every row runs the same number of steps. Returns (first token time,
    generated ids (batch, max_new_tokens))."""
    input_ids, attention_mask = _left_padded([r.prompt_token_ids for r in batch], pad_id)
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    max_new = max(r.output_tokens for r in batch)
    streamer = _FirstTokenStreamer(clock)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                              eos_token_id=None, pad_token_id=pad_id)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                         streamer=streamer)
    return streamer.first_token_s, out[:, input_ids.shape[1]:]


def run_hf_generate(model: torch.nn.Module, workload: list[BenchRequest], batch_size: int, pad_id: int,
                    clock: Clock = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                    ) -> list[RequestResult]:
    """Static batching: a batch starts when the previous one ends, with the requests that have
    arrived by then (up to batch_size; if none has, wait for the next). Every request in a batch gets
    its first token at the batch's first step and finishes when the whole batch returns. Each is
    credited only its own output length."""
    pending = sorted(workload, key=lambda r: r.arrival_s)
    records = {r.request_id: RequestResult.offline(r.request_id, r.arrival_s, r.output_tokens) for r in pending}
    start = clock()
    while pending:
        now = clock() - start
        if pending[0].arrival_s > now:
            sleep(pending[0].arrival_s - now)
            continue
        ready = [r for r in pending[:batch_size] if r.arrival_s <= now]
        pending = pending[len(ready):]
        first_token_s, generated = generate_static_batch(model, ready, pad_id, clock)
        finish = clock() - start
        if generated.shape[1] < max(r.output_tokens for r in ready):
            raise RuntimeError(f"generate stopped early: {generated.shape[1]} new tokens")
        for r in ready:
            rec = records[r.request_id]
            rec.first_token_s = finish if first_token_s is None else first_token_s - start
            rec.finish_s = finish
    return list(records.values())


def _cb_config(options: HFContinuousOptions) -> ContinuousBatchingConfig:
    known = {f.name for f in fields(ContinuousBatchingConfig)}
    given = dict(
        num_blocks=options.num_blocks, max_batch_tokens=options.max_batch_tokens,
        max_requests_per_batch=options.max_requests_per_batch, allow_block_sharing=False,
        auto_switch_to_flash=False, use_cuda_graph=options.use_cuda_graph,
        use_async_batching=options.use_async_batching, seed=0)
    # transformers up to 5.17 names the page size block_size and has no auto_switch_to_flash.
    given["page_size" if "page_size" in known else "block_size"] = options.page_size
    return ContinuousBatchingConfig(**{name: value for name, value in given.items() if name in known})


@torch.inference_mode()
def run_hf_continuous(model: torch.nn.Module, workload: list[BenchRequest], options: HFContinuousOptions,
                      ) -> list[RequestResult]:
    """transformers' ContinuousBatchingManager, fed each request at its arrival time with its own
    max_new_tokens and EOS disabled (-1). TTFT comes from the manager's own per-token timestamps
    (time.perf_counter, hence no clock argument); the finish time is when the caller receives the
    finished result. (`generate_batch` is the same manager, but takes one max_new_tokens for all
    requests and all of them at once, so it can serve neither exact lengths nor arrivals.)"""
    original_attn = model.config._attn_implementation
    model.set_attn_implementation(options.attn_implementation)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max(r.output_tokens for r in workload))
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=_cb_config(options))
    manager.start()
    try:
        return _drive_cb_manager(manager, workload)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
        model.set_attn_implementation(original_attn)


def _drive_cb_manager(manager: Any, workload: list[BenchRequest]) -> list[RequestResult]:
    pending = sorted(workload, key=lambda r: r.arrival_s)
    records = {r.request_id: RequestResult.offline(r.request_id, r.arrival_s, r.output_tokens) for r in pending}
    num_finished = 0
    start = time.perf_counter()
    while num_finished < len(records):
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.output_tokens,
                                eos_token_id=-1, record_timestamps=True)
        # Block on results, but wake for the next arrival (a floor of 1 ms avoids a blocking get).
        wait_s = 0.5 if not pending else min(0.5, pending[0].arrival_s - now)
        result = manager.get_result(timeout=max(wait_s, 0.001))
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching thread died")
            continue
        if not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"{result.request_id}: {result.error}")
        rec = records[result.request_id]
        rec.finish_s = time.perf_counter() - start
        if len(result.generated_tokens) != rec.output_tokens:
            raise RuntimeError(f"{rec.request_id}: {len(result.generated_tokens)} tokens, "
                               f"asked for {rec.output_tokens}")
        rec.first_token_s = result.timestamps[0] - start
        num_finished += 1
    return list(records.values())
