"""The discrete-event loop: a heap of (time, order, callback). Pure Python, no wall clock."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any


class EventLoop:
    """Callbacks run in time order; callbacks at the same time run in the order they were added.

    `clock` is what the real components take as their clock (Scheduler, AdmissionController), so
    they read simulated time.

    A run's arrivals come as one stream (`feed`) instead of one heap entry each: a million
    arrivals in the heap make every push and pop of the run walk 20 levels of it, out of cache.
    The stream is merged in time order and runs first at equal times, as if every arrival had
    been added before any other event.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.num_events = 0
        # The fed stream: (time, item) in time order, what is left of it from _next on.
        self._stream: list[tuple[float, Any]] = []
        self._stream_callback: Callable[[Any], Any] | None = None
        self._next = 0
        self._stopping = False

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

    def feed(self, events: Iterable[tuple[float, Any]], callback: Callable[[Any], Any]) -> None:
        """callback(item) at each (time, item): the same as at(time, callback, item) for each,
        called before any other event is added, in the order given at equal times. Once per loop."""
        if self._stream_callback is not None:
            raise RuntimeError("this loop was fed a stream already")
        stream = list(events)
        for time_s, _ in stream:
            if not math.isfinite(time_s):
                raise ValueError(f"event at {time_s} is not a finite time")
            if time_s < self.now:
                raise ValueError(f"event at {time_s} is before now ({self.now})")
        stream.sort(key=lambda event: event[0])  # stable: equal times keep their order
        self._stream, self._stream_callback, self._next = stream, callback, 0

    def stop(self) -> None:
        """End run() once the event running now returns (events left stay for a later run())."""
        self._stopping = True

    def run(self, until_s: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to until_s (or until no event is left, or stop() says so after an event,
        or an event calls stop())."""
        self._stopping = False
        heap, stream, feed = self._heap, self._stream, self._stream_callback
        next_fed = stream[self._next][0] if self._next < len(stream) else math.inf
        while True:
            if next_fed < math.inf and next_fed <= until_s and (not heap or next_fed <= heap[0][0]):
                self.now = next_fed
                item = stream[self._next][1]
                self._next += 1
                next_fed = stream[self._next][0] if self._next < len(stream) else math.inf
                feed(item)  # type: ignore[misc]
            elif heap and heap[0][0] <= until_s:
                time_s, _, callback, args = heapq.heappop(heap)
                self.now = time_s
                callback(*args)
            else:
                break
            self.num_events += 1
            if self._stopping or (stop is not None and stop()):
                self._stopping = False
                return
        if until_s != math.inf and until_s > self.now:
            self.now = until_s

    def __len__(self) -> int:
        return len(self._heap) + len(self._stream) - self._next
