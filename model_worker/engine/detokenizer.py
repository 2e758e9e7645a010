"""Incremental detokenization with stop strings.

Text is emitted only once it is final: never half of a multi-byte UTF-8 character (a byte-level
BPE token can end mid-character; its decode then ends in U+FFFD), and never a prefix of a stop
string that the next tokens might complete. A stop string ends generation and is not returned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Prompt tokens decoded in front of the output so that tokenizers which drop a leading space at
# the start of a decode (SentencePiece) still produce the right first characters.
_CONTEXT_TOKENS = 5


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=True)` gives it. For a
    transformers tokenizer over a Rust `tokenizers.Tokenizer` that cleans up no spaces, that
    Tokenizer's own decode, which is what transformers calls after converting its argument and
    reading its options: 1.1 against 4.9 us a call (tiny tokenizer), 2.3 against 3.8 (SmolLM2's).
    A decode step makes two calls per sequence: at batch 256 on the tiny model the step's host
    time went from 3.87 to 2.35 ms with it (docs/benchmarks.md, 'third pass')."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (type(backend).__name__ == "Tokenizer" and type(backend).__module__.startswith("tokenizers")
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        decode = backend.decode

        def direct(ids: list[int]) -> str:
            return decode(ids, skip_special_tokens=True)

        direct.direct = True  # type: ignore[attr-defined]
        return direct
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._decode = text_decoder(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = list(stop)
        # A stop string can straddle tokens: hold back this many trailing characters.
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._num_emitted = 0
        self.stopped_on: str | None = None

    def add_token(self, token_id: int) -> str:
        """Feed one output token; return the text that became final."""
        self._ids.append(token_id)
        if self.stopped_on is not None:
            return ""
        delta = self._decode_delta()
        if not delta:
            return ""
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        if self._stop:
            self._check_stop(search_from)
            if self.stopped_on is not None:
                return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback)

    def flush(self) -> str:
        """At the end: whatever was held back (a partial character stays unreadable and is
        dropped by the tokenizer's own decode)."""
        if self.stopped_on is None:
            tail = self._decode(self._ids[self._prefix_offset:])
            head = self._decode(self._ids[self._prefix_offset:self._read_offset])
            if len(tail) > len(head):
                self.text += tail[len(head):].rstrip("\ufffd")
                self._read_offset = len(self._ids)
        return self._take(len(self.text))

    def _decode_delta(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _check_stop(self, search_from: int) -> None:
        best = -1
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best == -1 or index < best):
                best, self.stopped_on = index, stop
        if best != -1:
            self.text = self.text[:best]

    def _take(self, upto: int) -> str:
        if upto <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted:upto]
        self._num_emitted = upto
        return delta
