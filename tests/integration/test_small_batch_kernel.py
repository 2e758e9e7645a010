"""Decode steps of a few sequences through our small-batch kernel (EngineConfig.small_batch_kernel):
the same greedy text as oneDNN's packed matmuls, on the trained model, and the kernel really run."""

from __future__ import annotations

import pytest
import torch

from model_worker import EngineConfig, LLMEngine, SamplingParams
from model_worker.runner import linear as packed
from model_worker.runner.cpu_kernels import ops

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (ops.has_small_linear(torch.float32) and packed.packs("cpu", torch.float32)),
                                 reason="needs our kernels with AVX-512 BW and oneDNN")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def greedy(engine: LLMEngine, tokenizer, prompts: list[str], max_tokens: int = 24) -> dict[str, list[int]]:
    for i, text in enumerate(prompts):
        engine.add_request(str(i), tokenizer.encode(text), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_few_row_steps_give_the_packed_matmuls_text_and_run_the_kernel(smollm2_dir, monkeypatch):
    off = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", small_batch_kernel=False, num_kv_blocks=64))
    decoder = off.runner.model
    assert decoder.small_rows == 0 and all(layer.plain is None for layer in decoder.weights.layers)
    tokenizer = off.runner.tokenizer
    # Three at once (steps of 3 rows), and one alone (1 row).
    expected = greedy(off, tokenizer, PROMPTS) | {"alone": greedy(off, tokenizer, PROMPTS[:1])["0"]}
    del off, decoder

    calls = []
    real = ops.small_linear
    monkeypatch.setattr(ops, "small_linear", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    on = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", num_kv_blocks=64))
    assert on.runner.model.small_rows == 3
    assert all(layer.plain is not None for layer in on.runner.model.weights.layers)
    got = greedy(on, on.runner.tokenizer, PROMPTS) | {"alone": greedy(on, on.runner.tokenizer, PROMPTS[:1])["0"]}
    assert got == expected
    assert set(calls) == {1, 3}  # 3 rows for the layers of the batch of three, 1 for the lone request
