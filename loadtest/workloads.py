"""Serving workloads: synthetic, trace replay, shared prefixes, multi-turn, priority mixes. Pure.

Every generator is seeded: the same arguments give the same requests, token for token. Prompts are
token ids drawn from the model's normal (non-special) ids and sent as ids, so every prompt has
exactly the length asked for; outputs are fixed lengths (clients send ignore_eos).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from loadtest.traces import (BenchRequest, LengthScaler, TraceRow, build_prompt, gamma_arrivals, poisson_arrivals,
                             scale_time)


@dataclass(slots=True, frozen=True)
class LengthDist:
    """Token lengths: `fixed` (mean), `uniform` (low..high) or `lognormal` (median `mean`, shape
    `sigma`), clamped to [low, high]."""

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    mean: int = 128
    low: int = 1
    high: int = 1024
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"kind must be fixed, uniform or lognormal, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low} and {self.high}")
        if not self.low <= self.mean <= self.high:
            raise ValueError(f"mean {self.mean} must lie in [low, high] = [{self.low}, {self.high}]")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma!r}")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, self.mean)
        elif self.kind == "uniform":
            values = rng.integers(self.low, self.high + 1, size=n)
        else:
            values = np.rint(rng.lognormal(np.log(self.mean), self.sigma, size=n))
        return [int(v) for v in np.clip(values, self.low, self.high)]


def arrivals(num_requests: int, rate_per_s: float | None, pattern: str, seed: int, cv: float = 2.0) -> list[float]:
    """`poisson` or `gamma` (bursty, coefficient of variation `cv`) at `rate_per_s`; rate None or
    pattern `burst` sends everything at 0."""
    if pattern == "burst" or rate_per_s is None:
        return [0.0] * num_requests
    if pattern == "poisson":
        return poisson_arrivals(num_requests, rate_per_s, seed)
    if pattern == "gamma":
        return gamma_arrivals(num_requests, rate_per_s, cv, seed)
    raise ValueError(f"arrival pattern must be poisson, gamma or burst, got {pattern!r}")


def step_arrivals(phases: list[tuple[float, float]], seed: int) -> list[float]:
    """Poisson arrivals whose rate steps: `phases` is [(duration_s, rate_per_s), ...] in order
    (rate 0 is a silent phase). Each phase draws its own seeded gaps, so a phase's arrivals do not
    depend on the phases before it."""
    times: list[float] = []
    start_s = 0.0
    for index, (duration_s, rate_per_s) in enumerate(phases):
        if not (duration_s > 0 and rate_per_s >= 0):
            raise ValueError(f"phase {index}: duration_s must be > 0 and rate_per_s >= 0, got "
                             f"({duration_s!r}, {rate_per_s!r})")
        if rate_per_s > 0:
            rng = np.random.default_rng([seed, index])
            t = start_s + rng.exponential(1.0 / rate_per_s)
            while t < start_s + duration_s:
                times.append(float(t))
                t += rng.exponential(1.0 / rate_per_s)
        start_s += duration_s
    return times


def synthetic(num_requests: int, prompt: LengthDist, output: LengthDist, arrivals_s: list[float],
              token_pool: np.ndarray, seed: int) -> list[BenchRequest]:
    if len(arrivals_s) != num_requests:
        raise ValueError(f"{len(arrivals_s)} arrivals for {num_requests} requests")
    rng = np.random.default_rng(seed)
    prompt_lens, output_lens = prompt.sample(num_requests, rng), output.sample(num_requests, rng)
    return _sorted([BenchRequest(f"req-{i}", build_prompt(p, token_pool, rng), o, a)
                    for i, (p, o, a) in enumerate(zip(prompt_lens, output_lens, arrivals_s))])


def trace_replay(rows: list[TraceRow], num_requests: int, token_pool: np.ndarray, seed: int,
                 speedup: float = 1.0, scaler: LengthScaler = LengthScaler(), start_row: int = 0
                 ) -> list[BenchRequest]:
    """Consecutive trace rows from `start_row`, their arrivals `speedup` times faster (first at 0)
    and their lengths scaled, so a run fits a small model and a small machine."""
    window = rows[start_row:start_row + num_requests]
    if len(window) < num_requests:
        raise ValueError(f"the trace has {len(rows) - start_row} rows from row {start_row}; asked {num_requests}")
    times = scale_time([r.arrival_s for r in window], speedup)
    rng = np.random.default_rng(seed)
    return _sorted([BenchRequest(f"req-{i}", build_prompt(scaler.prompt_tokens(r.context_tokens), token_pool, rng),
                                 scaler.output_tokens(r.generated_tokens), t)
                    for i, (r, t) in enumerate(zip(window, times))])


def trace_rate(rows: list[TraceRow], num_requests: int, start_row: int = 0) -> float:
    """The mean request rate of a trace window, to turn a target rate into a speedup."""
    window = rows[start_row:start_row + num_requests]
    span_s = window[-1].arrival_s - window[0].arrival_s
    if len(window) < 2 or span_s <= 0:
        raise ValueError("need at least two rows spanning some time")
    return (len(window) - 1) / span_s


def shared_prefix(num_prefixes: int, requests_per_prefix: int, prefix_tokens: int, suffix_tokens: int,
                  output_tokens: int, arrivals_s: list[float], token_pool: np.ndarray, seed: int
                  ) -> list[BenchRequest]:
    """K system prompts, each shared by many requests: request i uses prefix i % K followed by its
    own random suffix. Arrivals are interleaved across prefixes, as users of K apps would be."""
    num_requests = num_prefixes * requests_per_prefix
    if len(arrivals_s) != num_requests:
        raise ValueError(f"{len(arrivals_s)} arrivals for {num_requests} requests")
    rng = np.random.default_rng(seed)
    prefixes = [build_prompt(prefix_tokens, token_pool, rng) for _ in range(num_prefixes)]
    return _sorted([BenchRequest(f"req-{i}", prefixes[i % num_prefixes] + build_prompt(suffix_tokens, token_pool, rng),
                                 output_tokens, a) for i, a in enumerate(arrivals_s)])


def multi_turn(num_conversations: int, turns: int, system_tokens: int, user_tokens: int, answer_tokens: int,
               arrivals_s: list[float], token_pool: np.ndarray, seed: int, think_time_s: float = 0.0,
               num_system_prompts: int | None = None) -> list[BenchRequest]:
    """Conversations whose every turn extends the previous turn's prompt: turn t+1 is turn t's
    prompt, a stand-in for its answer (`answer_tokens` fixed ids, as a chat history would hold) and
    a new user message. Turn t+1 is sent `think_time_s` after turn t finished (`after_id`).
    With `num_system_prompts` K, conversation c opens with system prompt c % K (K apps, each with
    many users); without, every conversation has its own."""
    if len(arrivals_s) != num_conversations:
        raise ValueError(f"{len(arrivals_s)} arrivals for {num_conversations} conversations")
    rng = np.random.default_rng(seed)
    systems = [build_prompt(system_tokens, token_pool, rng) for _ in range(num_system_prompts or 0)]
    requests = []
    for c, start_s in enumerate(arrivals_s):
        system = systems[c % len(systems)] if systems else build_prompt(system_tokens, token_pool, rng)
        prompt = system + build_prompt(user_tokens, token_pool, rng)
        previous = None
        for t in range(turns):
            request_id = f"conv-{c}-turn-{t}"
            requests.append(BenchRequest(request_id, prompt, answer_tokens, start_s if previous is None else think_time_s,
                                         after_id=previous))
            prompt = prompt + build_prompt(answer_tokens, token_pool, rng) + build_prompt(user_tokens, token_pool, rng)
            previous = request_id
    return requests


def with_batch_fraction(workload: list[BenchRequest], fraction: float, seed: int) -> list[BenchRequest]:
    """Tag a seeded random `fraction` of the requests `batch` priority (the rest interactive)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    num_batch = int(round(fraction * len(workload)))
    chosen = set(np.random.default_rng(seed).choice(len(workload), size=num_batch, replace=False).tolist())
    return [dataclasses.replace(r, priority="batch" if i in chosen else "interactive") for i, r in enumerate(workload)]


def _sorted(requests: list[BenchRequest]) -> list[BenchRequest]:
    return sorted(requests, key=lambda r: r.arrival_s)
