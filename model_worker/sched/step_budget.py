"""Stall-free batching: how many prompt tokens a step may carry beside running decodes.

A fixed token budget lets a prompt join a step whole, and every running request waits for it:
on a CPU a 256-token prompt makes that step several times a decode step. Sarathi-Serve's answer
is a budget the step can afford. Here a step's time is modelled as D(d) + c * p: D the time of a
pure decode step at d decodes, c the cost of one prompt token, both learnt from the steps the
engine has run (moving averages; D per power-of-two bucket of d). Beside d > 0 running decodes, a
step carries at most k * (max_slowdown - 1) * D(d) / c prompt tokens for k prompts in flight
(waiting, or part-way through their prefill), never fewer than `min_tokens`, so prompts always
move. With one prompt in flight, the common case under light load, no decode step takes more than
about max_slowdown pure decode steps. Each further prompt gets a share of its own: with a fixed
cap, a burst of k prompts would be prefilled k times slower, the last one's TTFT growing with k
and throughput falling (a 2x cap served 16 requests sent at once at 46 tok/s against 96 uncapped,
SmolLM2 bf16 on 2 cores: docs/benchmarks.md, 'Stall-free batching').
With no decode running (an idle engine, so a lone request's TTFT is what it was), before both
terms have been measured, or with max_slowdown None, the whole token budget.

The times are the scheduler's clock between schedule() and update(): the runner's step in the
engine, and the step-time model's in the cluster simulator, which then schedules as the engine does.
"""

from __future__ import annotations

# Steps with fewer prompt tokens than this say too little about a token's cost to learn from.
MIN_SAMPLE_TOKENS = 16
# Weight of the newest sample in each moving average.
SMOOTHING = 0.2


def _bucket(num_decodes: int) -> int:
    return max(num_decodes, 1).bit_length()


class StepBudget:
    def __init__(self, max_tokens: int, max_slowdown: float | None, min_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.max_slowdown = max_slowdown
        self.min_tokens = min(min_tokens, max_tokens)
        # Seconds of a pure decode step, by bucket of the decode count.
        self.decode_step_s: dict[int, float] = {}
        # Seconds one prompt token adds to a step.
        self.prompt_token_s: float | None = None

    def prompt_tokens(self, num_decodes: int, num_prompts: int = 1) -> int:
        """Most prompt tokens the next step may carry beside `num_decodes` running decodes, with
        `num_prompts` prompts in flight. Never more than the token budget less one token per
        decode, so a prefill ahead of decodes in the running order leaves them theirs."""
        uncapped = max(self.max_tokens - num_decodes, self.min_tokens)
        if self.max_slowdown is None or num_decodes == 0 or self.prompt_token_s is None:
            return uncapped
        decode_s = self._decode_s(num_decodes)
        if decode_s is None or self.prompt_token_s <= 0:
            return uncapped
        affordable = int(max(num_prompts, 1) * (self.max_slowdown - 1) * decode_s / self.prompt_token_s)
        return max(self.min_tokens, min(affordable, uncapped))

    def record(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """What a step of `num_decodes` decodes and `num_prompt_tokens` prompt tokens took."""
        if seconds <= 0:
            return
        if num_prompt_tokens == 0:
            if num_decodes:
                bucket = _bucket(num_decodes)
                self.decode_step_s[bucket] = _average(self.decode_step_s.get(bucket), seconds)
            return
        if num_prompt_tokens < MIN_SAMPLE_TOKENS:
            return
        decode_s = self._decode_s(num_decodes)
        # Before any decode step is measured, the whole step over its prompt tokens: an upper
        # bound on a token's cost, so the first budgets err towards small chunks.
        per_token = (seconds - (decode_s or 0.0)) / num_prompt_tokens
        if per_token > 0:
            self.prompt_token_s = _average(self.prompt_token_s, per_token)

    def _decode_s(self, num_decodes: int) -> float | None:
        """D(num_decodes): its bucket's average, else the nearest bucket measured."""
        if not self.decode_step_s:
            return None
        bucket = _bucket(num_decodes)
        nearest = min(self.decode_step_s, key=lambda b: (abs(b - bucket), b))
        return self.decode_step_s[nearest]


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else old + SMOOTHING * (sample - old)
