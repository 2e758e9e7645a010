"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.checks import is_int, is_number

# Temperatures below this sample as greedy. The sampler divides float32 logits by the temperature:
# 1e-300 is 0 in float32 and a tiny one overflows to inf, and either gives NaN probabilities
# (which silently sampled token 0). Below 1e-5 the distribution is argmax to float32 precision
# anyway; vLLM uses the same threshold (_SAMPLING_EPS).
GREEDY_BELOW_TEMPERATURE = 1e-5
# top_p below this acts as this value. A smaller top_p rounds to 0 in float32, and the nucleus of
# any vocabulary under a million tokens is its top token alone at 1e-6 already (the top token's
# probability is at least 1 / vocab_size), so the clamp changes no result.
MIN_TOP_P = 1e-6
# The most stop strings per request, and the longest. Each stop string is searched for in the new
# text of every step, and the longest one sets how much text is held back: without a cap, 400k stop
# strings in one request slowed every request batched with it 7x. OpenAI allows 4; vLLM's users
# send a handful.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# The most stop token ids per request (checked against every sampled token).
MAX_STOP_TOKEN_IDS = 256


@dataclass(slots=True)
class SamplingParams:
    # Upper bound on generated tokens; the request also stops at EOS, a stop string or a stop id.
    max_tokens: int = 16
    # 0 means greedy (argmax); otherwise logits are divided by it before sampling. Values below
    # GREEDY_BELOW_TEMPERATURE become 0.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p
    # (values below MIN_TOP_P act as MIN_TOP_P).
    top_p: float = 1.0
    # Keep only the k most likely tokens; 0 or -1 disables the filter.
    top_k: int = 0
    # Same seed, same prompt, same params -> same tokens, whatever else is in the batch.
    seed: int | None = None
    # Generation stops when the text contains one of these; the stop string is not returned.
    # At most MAX_STOP_STRINGS, each at most MAX_STOP_STRING_CHARS characters.
    stop: list[str] = field(default_factory=list)
    # Generation stops after one of these token ids is sampled (the id is returned). At most
    # MAX_STOP_TOKEN_IDS.
    stop_token_ids: list[int] = field(default_factory=list)
    # Keep going past EOS (benchmarks use this to fix output lengths).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(is_int(self.max_tokens)
               and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {_short(self.max_tokens)}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", f"must be a number in [0, 100], got {_short(self.temperature)}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               "top_p", f"must be a number in (0, 1], got {_short(self.top_p)}")
        _check(is_int(self.top_k) and self.top_k >= -1,
               "top_k", f"must be an integer >= -1 (0 or -1 disables it), got {_short(self.top_k)}")
        _check(self.seed is None or (is_int(self.seed)
                                     and 0 <= self.seed < 2**63),
               "seed", f"must be an integer in [0, 2**63) or None, got {_short(self.seed)}")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop", f"must be a non-empty string or a list of non-empty strings, got {_short(self.stop)}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"strings may be at most {MAX_STOP_STRING_CHARS} characters long")
        _check(isinstance(self.stop_token_ids, list)
               and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", f"must be a list of non-negative integers, got {_short(self.stop_token_ids)}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {_short(self.ignore_eos)}")
        if self.top_k == -1:
            self.top_k = 0
        # Numerically safe values: a request must never reach a step with a value the sampler's
        # float32 arithmetic turns into NaN (see the constants above).
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = max(float(self.top_p), MIN_TOP_P)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingParamsError(ValueError):
    """Raised for an invalid sampling parameter; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _is_number(value: object) -> bool:
    return is_number(value) and value == value


def _short(value: object, limit: int = 200) -> str:
    """repr() cut to `limit` characters: an error message must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
