"""What a request must pass before it is queued: token ids, length, resumed tokens, block hashes.

These read only the tokenizer, the vocabulary size and the scheduler's config, never live engine
state, so they run wherever the request comes in: the engine's own add_request, and the process
that feeds an engine loop in another process (model_worker/engine/async_engine.py), which refuses a bad
request at once instead of sending it across and waiting for the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contracts.checks import is_int
from contracts.sampling import SamplingParams
from model_worker.config import SchedulerConfig
from model_worker.sched.hashing import ROOT_HASH, hash_block_tokens


class RequestRejected(ValueError):
    """A request that can never be served; `code` follows OpenAI's error codes where one fits."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param

    def __reduce__(self) -> tuple:  # code and param survive pickling
        return (type(self), (str(self), self.code, self.param))


class RequestChecker:
    def __init__(self, tokenizer: Any, vocab_size: int | None, config: SchedulerConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: a string is encoded, a list of ids is checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this engine has no tokenizer: pass token ids", param="prompt")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
            raise RequestRejected("prompt must be a string or a list of token ids", param="prompt")
        limit = self.vocab_size
        bad = [t for t in prompt if t < 0 or (limit is not None and t >= limit)]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary [0, {limit})",
                                  code="invalid_token_id", param="prompt")
        return list(prompt)

    def check_resumed(self, resumed_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Resumed output tokens, checked: token ids, and fewer than max_tokens."""
        if not resumed_token_ids:
            return []
        if not isinstance(resumed_token_ids, (list, tuple)):
            raise RequestRejected("resumed_token_ids must be a list of token ids", param="resumed_token_ids")
        resumed = self.tokenize(list(resumed_token_ids))
        if len(resumed) >= params.max_tokens:
            raise RequestRejected(f"{len(resumed)} resumed tokens leave nothing to generate within max_tokens "
                                  f"{params.max_tokens}", param="resumed_token_ids")
        return resumed

    def check_block_hashes(self, block_hashes: Sequence[int] | None, prompt_token_ids: Sequence[int],
                           cache_key: str | None) -> list[int]:
        """Block hashes a caller sent, checked before the cache trusts them: one int per full
        block of the prompt, and the first equal to this engine's own hash of the first block (a
        caller hashing with another block size or cache key differs there). [] when none came or
        prefix caching is off: the engine hashes the prompt itself."""
        config = self.config
        if not block_hashes or not config.enable_prefix_caching:
            return []
        if not isinstance(block_hashes, (list, tuple)) or any(type(h) is not int for h in block_hashes):
            raise RequestRejected("block_hashes must be a list of ints", param="block_hashes")
        size = config.block_size
        num_full = len(prompt_token_ids) // size
        if len(block_hashes) != num_full:
            raise RequestRejected(f"{len(block_hashes)} block hashes for a prompt of {num_full} full blocks of {size} "
                                  "tokens: the caller hashed with another block size", param="block_hashes",
                                  code="invalid_block_hashes")
        if block_hashes[0] != hash_block_tokens(ROOT_HASH, prompt_token_ids[:size], cache_key):
            raise RequestRejected("block_hashes do not match this engine's hash of the prompt's first block: the "
                                  "caller hashed with another block size or cache_key", param="block_hashes",
                                  code="invalid_block_hashes")
        return list(block_hashes)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_fits(self.config, num_prompt_tokens, max_tokens)


def check_fits(config: SchedulerConfig, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise RequestRejected for a request that could never run: empty, longer than the model's
    positions, or needing more KV blocks than the whole cache has."""
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty", code="empty_prompt", param="prompt")
    total = num_prompt_tokens + max_tokens
    if total > config.max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {config.max_model_len} tokens; the request "
            f"asks for {total} ({num_prompt_tokens} in the prompt + {max_tokens} max_tokens)",
            code="context_length_exceeded", param="max_tokens")
    blocks = -(-total // config.block_size)
    if blocks > config.num_kv_blocks:
        raise RequestRejected(
            f"the request needs {blocks} KV blocks ({total} tokens) but the whole cache has "
            f"{config.num_kv_blocks}", code="context_length_exceeded", param="max_tokens")
