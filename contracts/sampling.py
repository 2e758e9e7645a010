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
# The most alternatives per token a request may ask for with `logprobs` (vLLM's default
# max_logprobs, and OpenAI's limit for chat's top_logprobs).
MAX_LOGPROBS = 20
# Structured output: what a grammar may be given as, and the longest spec text taken.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 256 * 1024
# The most logit_bias entries per request (OpenAI documents none; the bias is applied as one
# scatter over the step's rows, and a body of a million entries must not reach it).
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow: `kind` "json" (`value` a JSON schema as JSON text),
    "json_object" (any JSON object; no value), "regex", "choice" (`value` a JSON list of the
    strings allowed) or "grammar" (EBNF, xgrammar's dialect). `param` is the request field it came
    from, named in errors."""

    kind: str
    value: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, self.param, f"kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                                          f"got {_short(self.kind)}")
        _check(isinstance(self.value, str) and len(self.value) <= MAX_STRUCTURED_CHARS, self.param,
               f"must be a text of at most {MAX_STRUCTURED_CHARS} characters")
        _check(bool(self.value) or self.kind == "json_object", self.param, "must not be empty")


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
    # Penalties on tokens already seen, as OpenAI and vLLM define them: presence subtracts its value
    # from the logit of every token the output holds, frequency its value times the count;
    # repetition (1: off) divides a positive logit (multiplies a negative one) of every token the
    # prompt or the output holds. presence and frequency in [-2, 2], repetition in (0, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Added to the logits of these token ids before sampling (values in [-100, 100]); at most
    # MAX_LOGIT_BIAS entries. Ids are checked against the vocabulary by the engine.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # EOS and the stop token ids cannot be sampled before this many output tokens.
    min_tokens: int = 0
    # Return the log probability of each sampled token and of the `logprobs` most likely tokens
    # (0: the sampled token's alone; None: none), from the distribution the token was drawn from:
    # the logits after min_tokens, logit_bias and the penalties, divided by the temperature (when
    # not greedy), before top-k and top-p. At most MAX_LOGPROBS.
    logprobs: int | None = None
    # The same for every prompt token but the first (vLLM's prompt_logprobs): the log probability
    # the model gave it after the tokens before it, and the `prompt_logprobs` most likely tokens
    # there, from the raw logits (no processing applies to a prompt). A request that asks computes
    # its whole prompt: the prefix cache holds no logits. At most MAX_LOGPROBS.
    prompt_logprobs: int | None = None
    # The output follows this grammar (each step's disallowed tokens get -inf, after the penalties
    # and the bias); None: free text.
    structured: StructuredOutput | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, f"must be a number in [-2, 2], got {_short(value)}")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be a number in (0, 2], got {_short(self.repetition_penalty)}")
        _check(isinstance(self.logit_bias, dict) and all(
            is_int(k) and k >= 0 and _is_number(v) and -100.0 <= v <= 100.0 for k, v in self.logit_bias.items()),
            "logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100], "
                          f"got {_short(self.logit_bias)}")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens ({_short(self.max_tokens)})], got {_short(self.min_tokens)}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
               f"must be a StructuredOutput or None, got {_short(self.structured)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {_short(value)}")
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

    @property
    def penalises_history(self) -> bool:
        """Whether sampling reads the tokens already seen (a presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling: a penalty, a bias, or a min_tokens."""
        return bool(self.penalises_history or self.logit_bias or self.min_tokens)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded with `seed` (n > 1): the first keeps the
    request's seed, so n = 1 draws as before; the others are spread by an odd 64-bit constant,
    each its own stream, and the same seed gives the same choices."""
    return seed if choice == 0 else (seed + choice * 0x9E3779B97F4A7C15) % 2**63


class SamplingParamsError(ValueError):
    """Raised for an invalid sampling parameter; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


class GrammarError(SamplingParamsError):
    """A structured-output spec the grammar library refuses (model_worker.runner.grammar)."""

    def __init__(self, param: str, message: str) -> None:
        ValueError.__init__(self, message)
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
