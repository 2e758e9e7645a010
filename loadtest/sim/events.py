"""The discrete-event loop: a heap of (time, order, callback). Pure Python, no wall clock."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Callbacks run in time order; callbacks at the same time run in the order they were added.

    `clock` is what the real components take as their clock (Scheduler, AdmissionController), so
    they read simulated time.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.num_events = 0

    def clock(self) -> float:
        return self.now

    def at(self, time_s: float, callback: Callable[..., Any], *args: Any) -> None:
        if time_s < self.now:
            raise ValueError(f"event at {time_s} is before now ({self.now})")
        heapq.heappush(self._heap, (time_s, next(self._order), callback, args))

    def after(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> None:
        if not delay_s >= 0:
            raise ValueError(f"delay must be >= 0, got {delay_s!r}")
        self.at(self.now + delay_s, callback, *args)

    def run(self, until_s: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to until_s (or until the heap is empty, or stop() says so after an event)."""
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            time_s, _, callback, args = heapq.heappop(heap)
            self.now = time_s
            callback(*args)
            self.num_events += 1
            if stop is not None and stop():
                return
        if until_s != math.inf and until_s > self.now:
            self.now = until_s

    def __len__(self) -> int:
        return len(self._heap)
