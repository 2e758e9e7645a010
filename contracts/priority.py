"""Request priority: one enum, and its lower-case labels as the API and the metrics spell them."""

from __future__ import annotations

import enum

from contracts.checks import is_int


class Priority(enum.IntEnum):
    """Lower value is served first; batch is shed first under overload."""

    INTERACTIVE = 0
    BATCH = 1

    @property
    def label(self) -> str:
        """"interactive" or "batch": the API's and the metrics' spelling."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: Priority | str | int) -> Priority:
        if isinstance(value, Priority):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if is_int(value) and value in cls._value2member_map_:
            return cls(value)
        names = ", ".join(m.label for m in cls)
        raise ValueError(f"priority must be one of {names}; got {value!r}")


# Every priority's label, highest first.
PRIORITIES: tuple[str, ...] = tuple(p.label for p in Priority)
