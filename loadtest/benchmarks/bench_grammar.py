"""The grammar libraries for structured output, compared on the real model's vocabulary: xgrammar,
llguidance and outlines-core.

    python -m loadtest.benchmarks.bench_grammar              # the 20 schemas, batch 1 and 32

For each library:
- **setup**: reading the tokenizer's vocabulary once (per model, at the first grammar);
- **compile**: each of the 20 schemas of loadtest/benchmarks/json_schemas.py, cold, one by one;
- **mask per step**: the token sequences of real answers (SmolLM2's greedy output for each schema
  under xgrammar, recorded first) replayed through each library's matcher: each step fills the
  next-token bitmask of every row, then advances every row by its token. Batch 1 is each schema
  alone; batch 32 is 32 rows (the 20 schemas, then again) filled together each step. The figure is
  the mean time of a step's fills. Recorded tokens a library's mask does not allow are counted.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from loadtest.benchmarks.json_schemas import SCHEMAS, prompt_for

LIBRARIES = ("xgrammar", "llguidance", "outlines_core")


class Library:
    """One grammar library behind the few calls the comparison makes."""

    name = ""

    def setup(self, tokenizer: Any, vocab_size: int) -> None: ...
    def compile(self, schema: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, masks: torch.Tensor, row: int) -> None: ...
    def advance(self, matcher: Any, token: int) -> None: ...
    def allocate(self, rows: int, vocab_size: int) -> torch.Tensor:
        return torch.zeros((rows, (vocab_size + 31) // 32), dtype=torch.int32)


class XGrammar(Library):
    name = "xgrammar"

    def setup(self, tokenizer, vocab_size):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(schema, strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, masks, row):
        matcher.fill_next_token_bitmask(masks, row)

    def advance(self, matcher, token):
        assert matcher.accept_token(token)


class LLGuidance(Library):
    name = "llguidance"

    def setup(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.fill_fn = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, schema):
        # Whitespace as xgrammar allows it (any amount between tokens), so that the same answers replay.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # llguidance compiles lazily: this is its start
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher, masks, row):
        self.fill_fn(matcher, masks, row)

    def advance(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class OutlinesCore(Library):
    name = "outlines_core"

    def setup(self, tokenizer, vocab_size):
        import outlines_core

        self.oc = outlines_core
        # The byte-level BPE alphabet back to bytes (GPT-2's table), so that each token is its bytes.
        decoder = {v: k for k, v in _bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        eos = tokenizer.eos_token_id
        for token, token_id in tokenizer.get_vocab().items():
            if token_id == eos or token_id >= vocab_size:
                continue
            if token in tokenizer.all_special_tokens:
                continue
            try:
                data = bytes(decoder[c] for c in token)
            except KeyError:
                continue
            tokens.setdefault(data, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(schema, r"[\n\t ]*")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, masks, row):
        matcher.write_mask_into(masks[row].data_ptr(), masks[row].numel(), masks.element_size())

    def advance(self, matcher, token):
        matcher.advance(token)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def record_answers(model: str | None, dtype: str, max_tokens: int) -> tuple[list[list[int]], Any, int]:
    """Each schema's greedy answer on the real model under xgrammar (our engine's structured output),
    with the model's tokenizer and vocabulary size."""
    from contracts.sampling import SamplingParams, StructuredOutput
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=2))
    tokenizer = engine.runner.tokenizer
    for index, (description, schema) in enumerate(SCHEMAS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_for(description)}],
                                             add_generation_prompt=True, tokenize=False)
        engine.add_request(str(index), tokenizer.encode(text, add_special_tokens=False), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, structured=StructuredOutput("json", json.dumps(schema))))
    answers: dict[str, list[int]] = {str(i): [] for i in range(len(SCHEMAS))}
    while engine.has_unfinished():
        for out in engine.step():
            answers[out.request_id] += out.token_ids
    eos = set(engine.runner.eos_token_ids)
    return ([[t for t in answers[str(i)] if t not in eos] for i in range(len(SCHEMAS))], tokenizer,
            engine.runner.vocab_size)


def measure(library: Library, tokenizer: Any, vocab_size: int, answers: list[list[int]], batch: int) -> dict:
    started = time.perf_counter()
    library.setup(tokenizer, vocab_size)
    setup_s = time.perf_counter() - started
    compile_ms = []
    compiled = []
    for _, schema in SCHEMAS:
        started = time.perf_counter()
        compiled.append(library.compile(json.dumps(schema)))
        compile_ms.append((time.perf_counter() - started) * 1e3)
    result: dict[str, Any] = {"setup_s": round(setup_s, 3), "compile_ms_median": round(statistics.median(compile_ms), 2),
                              "compile_ms_max": round(max(compile_ms), 2),
                              "compile_ms_total": round(sum(compile_ms), 1)}
    for rows in sorted({1, batch}):
        step_ms = []
        masked_out = 0
        groups = [list(range(len(SCHEMAS)))] if rows > 1 else [[i] for i in range(len(SCHEMAS))]
        for group in groups:
            members = [group[i % len(group)] for i in range(rows)]
            matchers = [library.matcher(compiled[s]) for s in members]
            masks = library.allocate(rows, vocab_size)
            for step in range(max(len(answers[s]) for s in members)):
                live = [r for r, s in enumerate(members) if step < len(answers[s])]
                started = time.perf_counter()
                for r in live:
                    library.fill(matchers[r], masks, r)
                step_ms.append((time.perf_counter() - started) * 1e3)
                for r in live:
                    token = answers[members[r]][step]
                    # A library may mask a token another allows (llguidance keeps property names to
                    # their canonical tokens): counted, and the row still advances by it.
                    masked_out += not (int(masks[r, token // 32]) >> (token % 32)) & 1
                    library.advance(matchers[r], token)
        result[f"mask_ms_per_step_batch_{rows}"] = round(statistics.mean(step_ms), 3)
        result[f"recorded_tokens_masked_out_batch_{rows}"] = masked_out
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    args = parser.parse_args(argv)
    answers, tokenizer, vocab_size = record_answers(args.model, args.dtype, args.max_tokens)
    results = {}
    classes = {cls.name: cls for cls in (XGrammar, LLGuidance, OutlinesCore)}
    for name in args.libraries.split(","):
        try:
            results[name] = measure(classes[name](), tokenizer, vocab_size, answers, args.batch)
        except Exception as exc:  # a library that cannot run here is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, results[name], file=sys.stderr)
    summary = {"answer_tokens": [len(a) for a in answers], "batch": args.batch, "libraries": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
