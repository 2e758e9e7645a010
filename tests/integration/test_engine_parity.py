"""The real engine on the tiny model against transformers' own greedy `generate` (the same checks
on SmolLM2, a trained model, with chat prompts: test_smollm2.py).

Every prompt runs batched with 15+ others (mixed lengths, chunked prefill, prefix caching,
preemption), and must produce token for token what `generate` gives for that prompt alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

from model_worker import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.integration

WORDS = ("the scheduler admits waiting requests while free blocks and the token budget allow it, "
         "so a short request never waits for a long one; chunked prefill keeps decodes moving. ").split()


def make_prompts(tokenizer, count: int, shared_prefix: str = "") -> list[list[int]]:
    prompts = []
    for i in range(count):
        n_words = 3 + (i * 37) % 180
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n_words))
        prompts.append(tokenizer.encode(shared_prefix + f"[{i}] " + text))
    return prompts


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return tiny_model_dir


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy continuation of each prompt alone, by transformers."""
    model = LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (*prompt, -max_new_tokens)
        if key not in cache:
            config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt]), generation_config=config)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return run


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def check_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_running == stats.num_waiting == 0


def assert_parity(tokens, prompts, max_tokens, reference):
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert tokens[f"r{i}"] == reference(prompt, n), f"request r{i} ({len(prompt)} prompt tokens) diverged"


def test_mixed_batch_matches_generate_alone(model_path, reference):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_batched_tokens=128, max_num_seqs=16,
                                    num_kv_blocks=512))
    prompts = make_prompts(engine.tokenizer, 18)
    assert max(map(len, prompts)) > 128, "some prompt must be prefilled in chunks"
    max_tokens = [4 + (i * 11) % 29 for i in range(len(prompts))]
    tokens = run_engine(engine, prompts, max_tokens)
    assert_parity(tokens, prompts, max_tokens, reference)
    check_all_blocks_free(engine)


def test_shared_prefix_with_prefix_caching_matches_generate(model_path, reference):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_batched_tokens=256, num_kv_blocks=512,
                                    enable_prefix_caching=True))
    system = "You are a careful assistant. " * 12
    prompts = make_prompts(engine.tokenizer, 16, shared_prefix=system)
    max_tokens = [6 + i % 9 for i in range(len(prompts))]
    # The first request warms the cache; the rest arrive later and hit it.
    first = run_engine(engine, prompts[:1], max_tokens[:1])
    tokens = run_engine(engine, prompts[1:], max_tokens[1:])
    tokens = {f"r{int(k[1:]) + 1}": v for k, v in tokens.items()} | first
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 15 * 16 * (len(engine.tokenizer.encode(system)) // 16 - 1)
    assert_parity(tokens, prompts, max_tokens, reference)
    check_all_blocks_free(engine)


def test_cache_small_enough_to_preempt_still_matches_generate(model_path, reference):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_batched_tokens=256, num_kv_blocks=48))
    prompts = make_prompts(engine.tokenizer, 16)
    max_tokens = [24 + (i * 7) % 17 for i in range(len(prompts))]
    tokens = run_engine(engine, prompts, max_tokens)
    assert engine.stats().num_preemptions > 0, "the cache was meant to force preemption"
    assert_parity(tokens, prompts, max_tokens, reference)
    check_all_blocks_free(engine)


def test_static_mode_gives_the_same_tokens(model_path, reference):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", batching="static", max_num_seqs=8, num_kv_blocks=512))
    prompts = make_prompts(engine.tokenizer, 10)
    max_tokens = [5 + i for i in range(len(prompts))]
    tokens = run_engine(engine, prompts, max_tokens)
    assert_parity(tokens, prompts, max_tokens, reference)
    check_all_blocks_free(engine)


def test_text_prompt_and_streamed_text(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine.add_request("t", "Continuous batching is", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    text, ids = "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.text
            ids += out.token_ids
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
