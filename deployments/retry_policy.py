"""RetryPolicy: how the ingress fails a request over to another replica (handle_backend.py). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from contracts.checks import is_int, is_number


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    # Attempts per request, the first included, each on another replica while there is one.
    max_attempts: int = 3
    # An attempt whose replica has not admitted the request (the first chunk) within this long is
    # abandoned. Admission is immediate on a live replica; only a frozen one, or a call queued in
    # the router because every replica is full, takes longer.
    first_reply_timeout_s: float = 5.0
    # A started stream with no chunk for this long is abandoned and resumed elsewhere. Replicas
    # send a keep-alive every second, so this is about a replica that froze, not a slow request.
    stall_timeout_s: float = 10.0
    # Pause before attempt k + 1 (k * this): time for the routers to learn of a dead replica.
    backoff_s: float = 0.1

    def __post_init__(self) -> None:
        if not is_int(self.max_attempts) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("first_reply_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not (isinstance(self.backoff_s, (int, float)) and 0 <= self.backoff_s <= 10):
            raise ValueError(f"backoff_s must be in [0, 10], got {self.backoff_s!r}")
