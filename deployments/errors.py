"""APIError: one error type from the engine replica to the HTTP client, shaped like OpenAI's.

It crosses Ray calls intact (Ray re-raises a replica's exception as a subclass of its class), so
the ingress and a Python handle caller both catch `APIError` and read the same fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model_worker.sched.request_checks import RequestRejected


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        # Sent as the Retry-After header (whole seconds, rounded up) on 429 and 503.
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.status, self.type, self.param, self.code, self.retry_after_s))

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def rejected(exc: RequestRejected) -> APIError:
    """The engine door's refusal (model_worker/sched/request_checks.py) as the client reads it:
    400, with the door's own message, code and param."""
    return invalid(exc.param, str(exc), exc.code)


def overloaded(message: str, retry_after_s: float) -> APIError:
    return APIError(message, 429, "rate_limit_exceeded", None, "overloaded", retry_after_s)


def not_ready(message: str, retry_after_s: float = 5.0) -> APIError:
    return APIError(message, 503, "service_unavailable", None, "not_ready", retry_after_s)


def internal(message: str) -> APIError:
    return APIError(message, 500, "internal_error", None, "internal_error")
