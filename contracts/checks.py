"""Type checks every part validates with. Python's bool is an int, and a JSON `true` must not pass
for a count or a token id."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (NaN included: callers that refuse it say so)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
