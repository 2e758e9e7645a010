"""A snapshot of one engine's state and counters: what `LLMEngine.stats()` returns."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class EngineStats:
    # Requests in the scheduler's queue, not yet scheduled (new, or preempted and waiting to be
    # recomputed), in all and by priority.
    num_waiting: int
    num_waiting_interactive: int
    num_waiting_batch: int
    num_running: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    # Blocks holding a cached prefix (in use or free but not yet evicted).
    num_cached_kv_blocks: int
    # Share of KV blocks in use, 0..1.
    kv_usage: float
    block_size: int
    max_model_len: int
    # Prompt tokens looked up in the prefix cache, and those found there (since start).
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Finished requests by reason: stop, length, abort, error.
    requests_finished: dict[str, int]
    # Output tokens per second over the last few seconds.
    tokens_per_s: float
    # Seconds in step(), in model forward, and in the runner's execute(), since start.
    step_time_s: float
    forward_time_s: float
    execute_time_s: float
    # TTFT percentiles over the engine's last requests (however old); None before any.
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    # Every block hash the prefix cache holds, when asked for (stats(include_block_hashes=True)).
    cached_block_hashes: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
