"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    # Upper bound on generated tokens; the request also stops at EOS, a stop string or a stop id.
    max_tokens: int = 16
    # 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p.
    top_p: float = 1.0
    # Keep only the k most likely tokens; 0 or -1 disables the filter.
    top_k: int = 0
    # Same seed, same prompt, same params -> same tokens, whatever else is in the batch.
    seed: int | None = None
    # Generation stops when the text contains one of these; the stop string is not returned.
    stop: list[str] = field(default_factory=list)
    # Generation stops after one of these token ids is sampled (the id is returned).
    stop_token_ids: list[int] = field(default_factory=list)
    # Keep going past EOS (benchmarks use this to fix output lengths).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
               and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               "top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
               "top_k", f"must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and 0 <= self.seed < 2**63),
               "seed", f"must be an integer in [0, 2**63) or None, got {self.seed!r}")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop", f"must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, list)
               and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", f"must be a list of non-negative integers, got {self.stop_token_ids!r}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingParamsError(ValueError):
    """Raised for an invalid sampling parameter; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
