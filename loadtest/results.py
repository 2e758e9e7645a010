"""What a benchmark run measured, per request and in summary. Pure Python.

One record and one summary serve both kinds of run: an HTTP load test (the client fills in a
RequestResult per request) and an offline engine run (bench_engine's drivers fill in the same
record, made by `RequestResult.offline`, and report `summarize_offline`, a flat view of `summarize`).

Times are seconds on one clock with 0 at the start of the run. A request is counted whatever
happened to it: refused (429), failed, or cut off by the run's time limit, never dropped. The
summary's conventions follow vLLM's serving benchmark: TTFT from sending to the first content
chunk, ITL between consecutive content chunks, TPOT = (E2E - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field
from typing import Any

from model_worker.engine.stats import percentile

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    request_id: str
    priority: str = "interactive"
    # When the workload scheduled it, and when the client actually sent it (None: never sent).
    arrival_s: float = 0.0
    sent_s: float | None = None
    # HTTP status of the response; 0 when none came (connection error, timeout, run cut off).
    status: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    # Tokens the server reported generating (usage.completion_tokens), else content chunks seen.
    output_tokens: int = 0
    # Arrival of the first content chunk, and of every content chunk (first included).
    first_token_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None or self.sent_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        if self.finish_s is None or self.sent_s is None:
            return None
        return self.finish_s - self.sent_s

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def offline(cls, request_id: str, arrival_s: float, output_tokens: int,
                first_token_s: float | None = None, finish_s: float | None = None) -> "RequestResult":
        """A request of an offline engine run, which has no HTTP. It counts as sent at its scheduled
        arrival, so a system that only takes it later pays for the wait, and as answered (200): a
        failing offline run raises rather than marking its requests."""
        return cls(request_id, arrival_s=arrival_s, sent_s=arrival_s, status=200, output_tokens=output_tokens,
                   first_token_s=first_token_s, finish_s=finish_s)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestResult":
        return cls(**data)


@dataclass(slots=True, frozen=True)
class SLO:
    """A request meets the SLO when it succeeded with TTFT and TPOT within these (None: no bound)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_s is not None and (result.ttft_s is None or result.ttft_s > self.ttft_s):
            return False
        tpot = result.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 (numpy's linear interpolation); None for each when there are none."""
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(results: list[RequestResult], slo: SLO = SLO(), duration_s: float | None = None
              ) -> dict[str, Any]:
    """Throughput, latency distributions, outcome counts and goodput of one run.

    duration_s defaults to the span from the first send to the last finish. Goodput is the share of
    *all* requests (failed and refused ones included) that met the SLO, and that count per second.
    """
    if not results:
        raise ValueError("no results to summarize")
    ok = [r for r in results if r.ok]
    if duration_s is None:
        starts = [r.sent_s for r in results if r.sent_s is not None]
        ends = [r.finish_s for r in results if r.finish_s is not None]
        duration_s = (max(ends) - min(starts)) if starts and ends else 0.0
    met = sum(1 for r in results if slo.met_by(r))
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_shed": sum(1 for r in results if r.status == 429),
        "num_errors": sum(1 for r in results if not r.ok and r.status != 429),
        "statuses": statuses,
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(sum(r.output_tokens for r in ok)),
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itls_s]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput": met / len(results),
        "goodput_rps": per_s(met),
    }


@dataclass(slots=True, frozen=True)
class RunSummary:
    """`summarize`'s figures of an offline engine run, flat, under the names bench_engine reports."""

    num_requests: int
    # Sum of the requests' own output tokens (no padding, no tokens past a request's length).
    useful_tokens: int
    # From the start of the run to the last finish.
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


def summarize_offline(results: list[RequestResult], start_s: float = 0.0) -> RunSummary:
    """`summarize` of an offline run, with wall time from `start_s` to the last finish. Raises if
    any request did not finish, so a broken run never reports numbers."""
    if not results:
        raise ValueError("no requests to summarize")
    unfinished = [r.request_id for r in results if not r.ok or r.first_token_s is None]
    if unfinished:
        raise ValueError(f"{len(unfinished)} requests unfinished, e.g. {unfinished[:3]}")
    wall_s = max(r.finish_s for r in results) - start_s  # type: ignore[type-var]
    # summarize would report 0 tokens/s here; an offline run that took no time is a broken clock.
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s!r}")
    s = summarize(results, duration_s=wall_s)
    ttft, e2e = s["ttft_s"], s["e2e_s"]
    return RunSummary(
        num_requests=s["num_requests"], useful_tokens=s["total_output_tokens"], wall_s=s["duration_s"],
        useful_tokens_per_s=s["output_throughput"],
        ttft_p50_s=ttft["p50"], ttft_p90_s=ttft["p90"], ttft_p99_s=ttft["p99"],
        e2e_p50_s=e2e["p50"], e2e_p90_s=e2e["p90"], e2e_p99_s=e2e["p99"],
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


def finite(value: Any) -> Any:
    """The JSON with NaN and infinities as null (json.dumps would write invalid NaN tokens)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
