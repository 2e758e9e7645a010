"""OutputProcessor: token ids to text, per request, outside the engine's step.

The engine loop emits token ids only. Text is made here, by the one who consumes the outputs: the
stream side of AsyncLLMEngine (on the replica's event loop, while the engine loop steps in its own
process), or LLMEngine.step itself when the engine is used alone. Each request has an
IncrementalDetokenizer (UTF-8 and stop-string safe); a stop string found here is reported to the
caller, which finishes the request in the engine: the step loop never decodes text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contracts.serving import GenerationChunk
from model_worker.engine.detokenizer import IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], stop: Sequence[str],
            resumed_token_ids: Sequence[int] = ()) -> None:
        """Start a request's text. Resumed tokens (produced by another engine, their text already
        sent) are fed first, so this request's text continues exactly where theirs ended."""
        if self.tokenizer is None:
            return
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop)
        for token in resumed_token_ids:
            detokenizer.add_token(token)
        self._detokenizers[request_id] = detokenizer

    def add_tokens(self, chunk: GenerationChunk) -> str | None:
        """Append the text of the chunk's tokens to chunk.text; return the stop string if one
        completed in this chunk (the text stops before it, and later tokens add nothing). A
        tokenizer that raises raises here: the caller fails that request alone."""
        detokenizer = self._detokenizers.get(chunk.request_id)
        if detokenizer is None:
            return None
        stopped_before = detokenizer.stopped_on is not None
        for token in chunk.token_ids:
            chunk.text += detokenizer.add_token(token)
        return None if stopped_before else detokenizer.stopped_on

    def finish(self, chunk: GenerationChunk) -> None:
        """The request ended with this chunk: append the text held back, forget the request."""
        detokenizer = self._detokenizers.pop(chunk.request_id, None)
        if detokenizer is not None:
            chunk.text += detokenizer.flush()

    def remove(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._detokenizers)
