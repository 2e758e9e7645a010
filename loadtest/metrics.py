"""Latency and throughput summaries of a benchmark run. Pure: standard library only.

All times are seconds on one clock, with 0 at the start of the run (the first arrival).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_worker.stats import percentile as engine_percentile


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    # When the request was submitted (its scheduled arrival; if the system only took it later, the
    # wait counts against that system's latency).
    arrival_s: float
    # The request's own output length: the only tokens it is credited for.
    output_tokens: int
    # When its first output token reached the caller; None while it has none.
    first_token_s: float | None = None
    # When its last token reached the caller; None while unfinished.
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float:
        if self.first_token_s is None:
            raise ValueError(f"{self.request_id}: no first token recorded")
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        if self.finish_s is None:
            raise ValueError(f"{self.request_id}: not finished")
        return self.finish_s - self.arrival_s


@dataclass(slots=True, frozen=True)
class RunSummary:
    num_requests: int
    # Sum of the requests' own output tokens (no padding, no tokens past a request's length).
    useful_tokens: int
    # From the first arrival to the last finish.
    wall_s: float
    useful_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p90_s: float
    e2e_p99_s: float

    def as_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in self.__slots__}


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation, as numpy's default; the engine's own."""
    if not values:
        raise ValueError("percentile of no values")
    return engine_percentile(values, q)


def useful_tokens_per_s(records: list[RequestRecord], wall_s: float) -> float:
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s!r}")
    return sum(r.output_tokens for r in records) / wall_s


def summarize(records: list[RequestRecord], start_s: float = 0.0) -> RunSummary:
    """Throughput and latency percentiles of finished requests; wall time runs from `start_s` to
    the last finish. Raises if any request did not finish, so a broken run never reports numbers."""
    if not records:
        raise ValueError("no requests to summarize")
    unfinished = [r.request_id for r in records if r.finish_s is None or r.first_token_s is None]
    if unfinished:
        raise ValueError(f"{len(unfinished)} requests unfinished, e.g. {unfinished[:3]}")
    wall_s = max(r.finish_s for r in records) - start_s  # type: ignore[type-var]
    ttfts = [r.ttft_s for r in records]
    e2es = [r.e2e_s for r in records]
    return RunSummary(
        num_requests=len(records),
        useful_tokens=sum(r.output_tokens for r in records),
        wall_s=wall_s,
        useful_tokens_per_s=useful_tokens_per_s(records, wall_s),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90), ttft_p99_s=percentile(ttfts, 99),
        e2e_p50_s=percentile(e2es, 50), e2e_p90_s=percentile(e2es, 90), e2e_p99_s=percentile(e2es, 99),
    )


def format_table(rows: dict[str, RunSummary]) -> str:
    """One line per system: tokens/s, TTFT and end-to-end percentiles in seconds."""
    header = f"{'system':<16} {'reqs':>5} {'tokens':>7} {'wall_s':>7} {'tok/s':>8} " \
             f"{'ttft_p50':>9} {'ttft_p99':>9} {'e2e_p50':>8} {'e2e_p99':>8}"
    lines = [header, "-" * len(header)]
    for name, s in rows.items():
        lines.append(f"{name:<16} {s.num_requests:>5} {s.useful_tokens:>7} {s.wall_s:>7.2f} "
                     f"{s.useful_tokens_per_s:>8.1f} {s.ttft_p50_s:>9.3f} {s.ttft_p99_s:>9.3f} "
                     f"{s.e2e_p50_s:>8.3f} {s.e2e_p99_s:>8.3f}")
    return "\n".join(lines)
