"""One request object with one status enum; no separate prefill and decode modes.

Each step moves `num_computed_tokens` toward `num_tokens` (prompt + output so far). A long prompt
catches up over several steps; a decoding request computes the one token it sampled last step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import RequestTimings
from model_worker.sched.hashing import ROOT_HASH, hash_block_tokens


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Finished states come after every live state: status > PREEMPTED means finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: Priority
    timings: RequestTimings
    # Arrival order, assigned by the scheduler: FCFS within a priority class, "latest" for preemption.
    arrival_seq: int = 0
    # Extra key mixed into every block hash (adapter, cache salt); requests with different keys
    # never share KV blocks.
    cache_key: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (for hit-rate stats).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Chained hashes of every full block of all_token_ids, extended as blocks fill.
    block_hashes: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), filled
    # as the prompt's chunks are computed and handed out with the first output token, after which
    # it is None and prompt_logprobs_sent is True (a recompute after preemption asks for none).
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    # With SamplingParams.structured: the request's grammar matcher (model_worker.runner.grammar),
    # advanced by every output token the engine keeps.
    grammar: Any = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the concatenation."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def update_block_hashes(self, block_size: int) -> None:
        """Hash every block that has become full since the last call."""
        num_full = self.num_tokens // block_size
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        for index in range(len(self.block_hashes), num_full):
            tokens = self.token_slice(index * block_size, (index + 1) * block_size)
            parent = hash_block_tokens(parent, tokens, self.cache_key)
            self.block_hashes.append(parent)
