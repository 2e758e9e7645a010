"""Benchmark workloads from the Azure LLM inference trace: lengths, arrivals and prompts.

Pure: the standard library and numpy only (no torch, no tokenizer), so every piece can be unit
tested without a model. A workload is a list of BenchRequest; every system in a benchmark run gets
the same list, so the same token ids, output lengths and arrival times.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

import numpy as np

# The conversation trace, shipped as package data (loadtest/data/README.md: source, CC BY 4.0).
DEFAULT_TRACE = "azure_llm_2023_conv.csv"


@dataclass(slots=True, frozen=True)
class TraceRow:
    # Seconds since the first row of the trace.
    arrival_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(slots=True, frozen=True)
class LengthScaler:
    """Maps the trace's production lengths onto what a small model serves in a benchmark.

    The trace's prompts (median ~1000 tokens) and outputs (median ~130) are sized for large models;
    dividing keeps the shape of the distribution while a whole run fits in minutes on a CPU.
    """

    # prompt_tokens = clamp(ContextTokens // prompt_divisor, prompt_min_tokens, prompt_max_tokens)
    prompt_divisor: float = 4.0
    prompt_min_tokens: int = 8
    prompt_max_tokens: int = 512
    # output_tokens = clamp(GeneratedTokens // output_divisor, output_min_tokens, output_max_tokens)
    output_divisor: float = 2.0
    output_min_tokens: int = 4
    output_max_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("prompt_divisor", "output_divisor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for low, high in (("prompt_min_tokens", "prompt_max_tokens"), ("output_min_tokens", "output_max_tokens")):
            if not 1 <= getattr(self, low) <= getattr(self, high):
                raise ValueError(f"need 1 <= {low} <= {high}, got {getattr(self, low)} and {getattr(self, high)}")

    def prompt_tokens(self, context_tokens: int) -> int:
        return _clamp(int(context_tokens // self.prompt_divisor), self.prompt_min_tokens, self.prompt_max_tokens)

    def output_tokens(self, generated_tokens: int) -> int:
        return _clamp(int(generated_tokens // self.output_divisor), self.output_min_tokens, self.output_max_tokens)


@dataclass(slots=True, frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Exact number of tokens to generate (EOS is ignored by every system under test).
    output_tokens: int
    # Seconds after the start of the run at which the request is submitted; with `after_id`,
    # seconds after that request finished (a user's think time between turns).
    arrival_s: float
    priority: str = "interactive"
    # Send only once this request has finished (the previous turn of a conversation).
    after_id: str | None = None


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def default_trace_path() -> Path:
    """The Azure conversation trace installed with the package."""
    return Path(str(resources.files("loadtest") / "data" / DEFAULT_TRACE))


def _parse_timestamp(text: str) -> datetime:
    # The trace writes 7 fractional digits (100 ns ticks); datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)


def load_azure_trace(path: str | Path) -> list[TraceRow]:
    """Rows of an Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), in file order.
    A file that cannot be read or parsed is a ValueError naming it."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: missing columns {sorted(missing)}")
            raw = [(_parse_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                   for r in reader]
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path} is not an Azure trace CSV: {exc}") from None
    if not raw:
        raise ValueError(f"{path}: no rows")
    start = raw[0][0]
    return [TraceRow((t - start).total_seconds(), c, g) for t, c, g in raw]


def scale_time(arrivals_s: list[float], speedup: float) -> list[float]:
    """Replays a timeline `speedup` times faster, shifted so the first arrival is at 0."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup!r}")
    if not arrivals_s:
        return []
    first = min(arrivals_s)
    return [(t - first) / speedup for t in arrivals_s]


def sample_lengths(rows: list[TraceRow], num_requests: int, scaler: LengthScaler,
                   seed: int) -> list[tuple[int, int]]:
    """(prompt_tokens, output_tokens) of `num_requests` rows drawn without replacement (with, if the
    trace is shorter), scaled. Same rows, scaler and seed -> same list."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(rows), size=num_requests, replace=num_requests > len(rows))
    return [(scaler.prompt_tokens(rows[i].context_tokens), scaler.output_tokens(rows[i].generated_tokens))
            for i in picks]


def all_at_once(num_requests: int) -> list[float]:
    return [0.0] * num_requests


def poisson_arrivals(num_requests: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process: exponential gaps with mean 1/rate; the first is at 0."""
    return gamma_arrivals(num_requests, rate_per_s, cv=1.0, seed=seed)


def gamma_arrivals(num_requests: int, rate_per_s: float, cv: float, seed: int) -> list[float]:
    """Arrivals with gamma-distributed gaps: mean 1/rate, coefficient of variation `cv`.

    cv=1 is Poisson; cv>1 is burstier (clusters of near-simultaneous requests, then lulls), as
    production traces are. The first request arrives at 0 so runs do not start with idle time.
    """
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s!r}")
    if not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv!r}")
    if num_requests < 1:
        return []
    shape = 1.0 / (cv * cv)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate_per_s * shape), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def normal_token_ids(vocab_size: int, special_ids: list[int] | set[int]) -> np.ndarray:
    """Ids in [0, vocab_size) that are not special tokens: safe filler for synthetic prompts."""
    special = set(special_ids)
    ids = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("no normal token ids left")
    return ids


def build_prompt(num_tokens: int, token_pool: np.ndarray, rng: np.random.Generator) -> tuple[int, ...]:
    """Exactly `num_tokens` ids drawn uniformly from `token_pool`. Fed to every system as ids, never
    re-tokenized text, so the prompt length is exact by construction."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return tuple(int(t) for t in rng.choice(token_pool, size=num_tokens))


def build_workload(lengths: list[tuple[int, int]], arrivals_s: list[float], token_pool: np.ndarray,
                   seed: int) -> list[BenchRequest]:
    """Requests req-0..req-{n-1} with seeded random prompts, sorted by arrival (stable)."""
    if len(lengths) != len(arrivals_s):
        raise ValueError(f"{len(lengths)} lengths but {len(arrivals_s)} arrivals")
    rng = np.random.default_rng(seed)
    requests = [BenchRequest(f"req-{i}", build_prompt(p, token_pool, rng), o, float(a))
                for i, ((p, o), a) in enumerate(zip(lengths, arrivals_s))]
    return sorted(requests, key=lambda r: r.arrival_s)
