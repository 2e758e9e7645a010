"""Structured output: a request's grammar (SamplingParams.structured) compiled against the model's
vocabulary, a matcher per request, and the token masks of a step. Built on xgrammar (the choice is
measured in docs/benchmarks.md, "Structured output": the per-step mask at batch 1 and 32 and the
compile time of 20 schemas, against llguidance and outlines-core).

- `GrammarCompiler.compile(spec)` compiles once per distinct spec (xgrammar caches the compiled
  grammars by their source) and raises GrammarError, naming the field, for a spec it cannot use:
  the ingress compiles every spec before it sends a request, so that an invalid schema or regex is
  a 400 and never reaches an engine.
- `GrammarCompiler.matcher(spec)` is a new matcher, at the grammar's start.
- `fill_masks(matchers, num_rows)` writes each matcher's allowed next tokens into a bitmask (one bit
  a token), and `apply_masks` sets every other logit of those rows to -inf.

A matcher advances by `accept(token)` once a step's token is kept (the engine does it after the
step). When the grammar is complete it allows only EOS; `is_terminated()` after accepting it.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from contracts.sampling import GrammarError, StructuredOutput

if TYPE_CHECKING:  # the engine imports this module without torch (GrammarError); the runner has it
    import torch


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 1) -> None:
        """GrammarError (param "structured_output") when this tokenizer cannot be read (one that
        cannot list its vocabulary, or none at all)."""
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        try:
            self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
            raise GrammarError("structured_output", "structured output is not available for this model: its "
                                                    f"tokenizer cannot be read ({_first_line(exc)})") from None
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)
        # One compile at a time: xgrammar's compiler is safe to share, but its cache fills once.
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec`; GrammarError for one the library refuses."""
        compiler = self._compiler
        try:
            with self._lock:
                if spec.kind == "json_object":
                    return compiler.compile_builtin_json_grammar()
                if spec.kind == "json":
                    return compiler.compile_json_schema(spec.value, strict_mode=True)
                if spec.kind == "regex":
                    return compiler.compile_regex(spec.value)
                if spec.kind == "choice":
                    choices = json.loads(spec.value)
                    return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
                return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(spec.param, f"{spec.param}: the grammar library cannot use this {spec.kind}: "
                                           f"{_first_line(exc)}") from None

    def matcher(self, spec: StructuredOutput) -> "Matcher":
        return Matcher(self._xgr.GrammarMatcher(self.compile(spec)))

    def allocate_masks(self, num_rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_masks(self, logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> None:
        """Every token a row's mask disallows gets -inf, in place (float32 logits): on the CPU by our
        kernel (xgrammar's CPU apply took 3.5 ms for 32 rows of SmolLM2's vocabulary; docs/
        benchmarks.md, "Structured output"), else by xgrammar's."""
        if logits.device.type == "cpu":
            from model_worker.runner.cpu_kernels import ops

            if ops.mask_rows(logits, masks, rows):
                return
        self._xgr.apply_token_bitmask_inplace(logits, masks.to(logits.device), indices=rows)


class Matcher:
    """One request's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, masks: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(masks, row)

    def accept(self, token: int) -> bool:
        """Advance by a kept token; False if the grammar does not allow it (nothing changes)."""
        return bool(self._matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
