"""The contract between the scheduler and a model runner: what to compute in one step.

The scheduler decides, the runner executes. A runner never changes request state; it only reads
this batch and returns one sampled token per sequence whose `sample` flag is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from contracts.sampling import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    request_id: str
    # Tokens whose KV is computed this step: a prompt chunk, recomputed tokens after a preemption,
    # or the one token sampled last step. Always known tokens, never a placeholder.
    token_ids: list[int]
    # Absolute position of token_ids[0]; equals the request's num_computed_tokens before the step.
    # Positions [0, start_position) are already in the KV cache (computed or prefix-cache hits).
    start_position: int
    # Physical KV block ids covering positions [0, start_position + len(token_ids)).
    block_table: list[int]
    # True when this chunk ends at the request's last known token: sample one new token from the
    # logits of token_ids[-1]. False for a prompt chunk that does not finish the prompt.
    sample: bool
    sampling_params: SamplingParams
    # How many output tokens the request already has: the index of the token sampled now.
    # Seeded sampling draws from (seed, output_index), so results never depend on the batch.
    output_index: int = 0
    # With sample=True and a penalty on tokens already seen (SamplingParams.penalises_history): the
    # request's prompt and output token ids, the request's own lists (read during the step, never
    # changed by the runner). None otherwise.
    history: tuple[list[int], list[int]] | None = None
    # Set while the request wants its prompt's logprobs and this chunk holds prompt positions whose
    # next token is a prompt token: the request's prompt token ids (its own list). The runner then
    # computes logits at every such position too.
    prompt_token_ids: list[int] | None = None
    # With sample=True and a grammar: the request's matcher; the runner masks the row's logits to
    # the tokens it allows next.
    grammar: Any = None

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step has run."""
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    # Running sequences first (decodes and ongoing chunked prefills), then newly admitted ones.
    sequences: list[ScheduledSequence] = field(default_factory=list)
    # Sum of len(token_ids) over sequences; never above max_num_batched_tokens.
    num_scheduled_tokens: int = 0
    # Requests preempted this step (their blocks were freed; they wait to be recomputed).
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.sequences

    @property
    def num_sampling(self) -> int:
        return [seq.sample for seq in self.sequences].count(True)


class ModelRunner(Protocol):
    """Runs one forward over the packed tokens of every scheduled sequence, then samples. Every
    member the engine and the replica read is declared here (TorchModelRunner, the tests' fake
    runners and model_worker.engine.step_padding.PaddedRunner have them all)."""

    # Number of KV blocks the runner allocated; the scheduler's block pool has exactly these.
    num_kv_blocks: int
    # Longest sequence (prompt + output) the model supports.
    max_model_len: int
    # Rows of the logits: token ids the model accepts are [0, vocab_size).
    vocab_size: int
    # Token ids that end a sequence, from the checkpoint.
    eos_token_ids: Sequence[int]
    # The checkpoint's Hugging Face tokenizer (None: token ids only).
    tokenizer: Any
    # Seconds in model forward and in execute() since the runner was built.
    forward_time_s: float
    execute_time_s: float
    # Seconds each part of loading took (weights, tokenizer, KV cache).
    load_times_s: dict[str, float]
    # Filled by execute() for each sampled row whose SamplingParams.logprobs is set: request id ->
    # (the token's log probability, the top ids, their log probabilities). The engine takes them
    # after the step; a runner that never gets such a row may leave it empty.
    sampled_logprobs: dict[str, tuple[float, list[int], list[float]]]
    # Filled by execute() for each sequence with prompt_token_ids: request id -> (the first prompt
    # position the entries are for, one (logprob, top ids, their logprobs) per position).
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[int], list[float]]]]]

    def execute(self, batch: SchedulerOutput) -> list[int]:
        """Return one sampled token id per sequence with sample=True, in batch order."""
        ...
