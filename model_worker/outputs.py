"""What the engine returns from each step, one object per request that made progress."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_worker.request import RequestTimings


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    # Token ids sampled this step (an EOS or stop token id included).
    new_token_ids: list[int] = field(default_factory=list)
    # Text that became final this step: never half a UTF-8 character, never a stop string.
    text_delta: str = ""
    finished: bool = False
    # "stop" (EOS, stop string or stop token), "length" (max_tokens), "error" (the step failed on
    # this request: `error` says how), or None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, if one did.
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    # Output tokens so far, this step's included.
    num_output_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # Set on the finished output.
    timings: RequestTimings | None = None
    # Why the request failed, with finish_reason "error"; None otherwise.
    error: str | None = None
