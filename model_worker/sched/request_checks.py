"""What a request must pass before it is queued: token ids, length, resumed tokens, block hashes.

These read only the tokenizer, the vocabulary size and the scheduler's config, never live engine
state, so they run where the request comes in: `RequestChecker.check` is the engine's door, run by
AsyncLLMEngine.add_request (before anything is sent to the engine process) and by
LLMEngine.add_request. Each refusal's message is written by one function below; whoever must
refuse calls it: the ingress, which refuses a request of several prompts whole before any is sent,
calls `check_token_ids`, `check_not_empty` and `check_context_length` itself, and the scheduler
guards its own invariant (a request must fit the whole KV cache) with `check_kv_capacity`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any, NamedTuple

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


# ---- one function per refusal -----------------------------------------------------------------


def check_token_ids(token_ids: Sequence[int], vocab_size: int | None, param: str = "prompt") -> None:
    """Every id inside the vocabulary [0, vocab_size); None: the size is unknown, any id >= 0."""
    bad = next((t for t in token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        where = "" if param == "prompt" else f"{param}: "  # a prompt's refusal reads as it always has
        raise RequestRejected(f"{where}token id {bad} is outside the vocabulary [0, {vocab_size})",
                              code="invalid_token_id", param=param)


def check_not_empty(num_prompt_tokens: int, param: str = "prompt", what: str = "the prompt") -> None:
    """A prompt of no tokens gives the model nothing to predict from. `what` names the prompt as
    its sender knows it (the ingress: the text as tokenized, or the chat template's output)."""
    if num_prompt_tokens == 0:
        raise RequestRejected(f"{what} is empty", code="empty_prompt", param=param)


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str = "max_tokens") -> int:
    """The max_tokens that fits: `max_tokens` itself when the prompt and it fit max_model_len
    positions, or with None (the OpenAI chat default) the rest of the context, at least one."""
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        if room < 1:
            raise RequestRejected(
                f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens}, leaving no room for output", code="context_length_exceeded", param=param)
        return room
    if max_tokens > room:
        raise RequestRejected(
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt + {max_tokens} max_tokens)",
            code="context_length_exceeded", param=param)
    return max_tokens


def check_kv_capacity(num_tokens: int, block_size: int, num_kv_blocks: int, param: str = "max_tokens") -> None:
    """A request whose `num_tokens` (prompt + max_tokens) need more KV blocks than the whole cache
    has would never run: it would wait, or preempt everything else, forever."""
    blocks = -(-num_tokens // block_size)
    if blocks > num_kv_blocks:
        raise RequestRejected(f"the request needs {blocks} KV blocks ({num_tokens} tokens) but the whole cache has "
                              f"{num_kv_blocks}", code="context_length_exceeded", param=param)


def check_request_id_unused(request_id: str, live_request_ids: Container[str]) -> None:
    if request_id in live_request_ids:
        raise RequestRejected(f"request id {request_id!r} is already in use", code="duplicate_request_id",
                              param="request_id")


# ---- the engine's door ------------------------------------------------------------------------


class CheckedRequest(NamedTuple):
    """A request's parts as the engine takes them, every check passed."""

    token_ids: list[int]
    resumed_token_ids: list[int]
    block_hashes: list[int]


class RequestChecker:
    def __init__(self, tokenizer: Any, vocab_size: int | None, config: SchedulerConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config

    def check(self, prompt: str | Sequence[int], params: SamplingParams, resumed_token_ids: Sequence[int] = (),
              block_hashes: Sequence[int] | None = None, cache_key: str | None = None) -> CheckedRequest:
        """Everything that can refuse a request, before it is queued: token ids, resumed tokens,
        block hashes, and that it fits the context and the KV cache. Raises RequestRejected."""
        token_ids = self.tokenize(prompt)
        if params.logit_bias:
            check_token_ids(list(params.logit_bias), self.vocab_size, "logit_bias")
        resumed = self.check_resumed(resumed_token_ids, params)
        hashes = self.check_block_hashes(block_hashes, token_ids, cache_key)
        self.check_limits(len(token_ids), params.max_tokens)
        return CheckedRequest(token_ids, resumed, hashes)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: a string is encoded, a list of ids is checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this engine has no tokenizer: pass token ids", param="prompt")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
            raise RequestRejected("prompt must be a string or a list of token ids", param="prompt")
        check_token_ids(prompt, self.vocab_size)
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

    def check_limits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Not empty, within the model's positions, within the whole KV cache."""
        config = self.config
        check_not_empty(num_prompt_tokens)
        check_context_length(num_prompt_tokens, max_tokens, config.max_model_len)
        check_kv_capacity(num_prompt_tokens + max_tokens, config.block_size, config.num_kv_blocks)
