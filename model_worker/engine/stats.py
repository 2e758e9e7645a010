"""Rolling engine statistics: recent TTFTs, token throughput, percentiles. Pure Python."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) by linear interpolation between closest ranks, as numpy's default."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class RollingStats:
    def __init__(self, window: int, rate_window_s: float = 10.0) -> None:
        self.ttfts_s: deque[float] = deque(maxlen=window)
        self.rate_window_s = rate_window_s
        # (time_s, tokens generated in that step), newest last.
        self._token_events: deque[tuple[float, int]] = deque()

    def record_ttft(self, ttft_s: float) -> None:
        self.ttfts_s.append(ttft_s)

    def record_tokens(self, now_s: float, num_tokens: int) -> None:
        if num_tokens:
            self._token_events.append((now_s, num_tokens))
        self._trim(now_s)

    def tokens_per_s(self, now_s: float) -> float:
        self._trim(now_s)
        if not self._token_events:
            return 0.0
        span_s = max(now_s - self._token_events[0][0], 1e-3)
        return sum(n for _, n in self._token_events) / span_s

    def ttft_percentiles(self) -> dict[str, float | None]:
        values = list(self.ttfts_s)
        return {f"ttft_p{q}_s": percentile(values, q) for q in (50, 90, 99)}

    def _trim(self, now_s: float) -> None:
        while self._token_events and self._token_events[0][0] < now_s - self.rate_window_s:
            self._token_events.popleft()
