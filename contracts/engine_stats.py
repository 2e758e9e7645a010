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
    # The prefix cache's change counter (BlockPool.cache_seq) as of this snapshot.
    cache_seq: int = 0
    # Every block hash the prefix cache holds, when asked for (stats(include_block_hashes=True)),
    # unless the changes since an earlier cache_seq were asked for and could be given (below).
    cached_block_hashes: tuple[int, ...] | None = None
    # With stats(include_block_hashes=True, block_hashes_since=SEQ): SEQ, and the hashes that
    # entered (stored) and left (removed) the prefix cache after change SEQ, by where they are
    # now (BlockPool.changes_since). None when not asked, or when the pool's log no longer reaches
    # SEQ (a gap): cached_block_hashes then holds every hash instead.
    block_hashes_since: int | None = None
    stored_block_hashes: tuple[int, ...] | None = None
    removed_block_hashes: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
