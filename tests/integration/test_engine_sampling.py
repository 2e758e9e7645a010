"""Sampling and streaming on the real default model, through the engine's public API."""

from __future__ import annotations

import asyncio

import pytest

from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from tests.unit.fakes import stats_once_aborted

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return tiny_model_dir


def generate_all(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return tokens


def test_same_seed_same_tokens_whatever_the_batch_and_preemption(model_path):
    seeded = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = generate_all(LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256)),
                         {"s": ("Seeded sampling is", seeded)})["s"]
    # Same request in a crowded batch on a cache small enough to preempt.
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64))
    noise = {f"n{i}": (f"noise request number {i} " * (i + 1), SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True))
             for i in range(6)}
    crowded = generate_all(engine, {"s": ("Seeded sampling is", seeded), **noise})
    assert engine.stats().num_preemptions > 0
    assert crowded["s"] == alone
    other_seed = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=4321, ignore_eos=True)
    different = generate_all(LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256)),
                             {"s": ("Seeded sampling is", other_seed)})["s"]
    assert different != alone, "another seed draws other tokens"


def test_top_k_one_is_greedy(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256))
    out = generate_all(engine, {
        "greedy": ("Top k of one", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        "k1": ("Top k of one", SamplingParams(max_tokens=20, temperature=1.5, top_k=1, ignore_eos=True)),
    })
    assert out["greedy"] == out["k1"]


def test_async_engine_streams_and_cancel_frees_blocks(model_path):
    engine = AsyncLLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256))

    async def main():
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        texts = await asyncio.gather(*(_text(engine, f"prompt {i}:", params) for i in range(4)))
        assert all(n == 24 for _, n in texts)
        async for out in engine.generate("a long one", SamplingParams(max_tokens=500, ignore_eos=True)):
            if out.num_output_tokens >= 3:
                break
        stats = await stats_once_aborted(engine)
        assert stats.num_running == 0 and stats.requests_finished["abort"] == 1
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


async def _text(engine: AsyncLLMEngine, prompt: str, params: SamplingParams) -> tuple[str, int]:
    text, ids = "", []
    async for out in engine.generate(prompt, params):
        text += out.text
        ids += out.token_ids
    # The random model can emit byte sequences that are not UTF-8 at all (shown as U+FFFD by any
    # decode); what streaming must never do is split a character the full decode keeps whole.
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    return text, len(ids)


def test_numerically_extreme_parameters_never_reach_a_step_as_nan(model_path):
    """Values a float32 step cannot represent never reach it as a zero or a NaN: `top_p: 1e-300`
    rounds to 0 in float32, which would make the sampler index -1 and fail every request batched
    beside it, and `temperature: 1e-300` would divide the logits by a float32 zero and silently
    give token 0. Each behaves as its limit (the top token alone, greedy)."""
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = generate_all(engine, {"g": ("Tiny values", greedy)})["g"]
    out = generate_all(engine, {
        "tiny_top_p": ("Tiny values", SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-300, ignore_eos=True)),
        "tiny_temperature": ("Tiny values", SamplingParams(max_tokens=12, temperature=1e-300, ignore_eos=True)),
        "both": ("Tiny values", SamplingParams(max_tokens=12, temperature=1e-30, top_p=1e-40, ignore_eos=True)),
        "bystander": ("Tiny values", greedy),
    })
    # The nucleus of top_p ~ 0 is the top token alone, and a temperature ~ 0 is greedy: all four
    # give the greedy tokens, and the bystander is unharmed.
    assert out == {name: reference for name in out}
    assert set(reference) != {0}


def test_a_step_that_raises_on_one_request_fails_only_that_request(model_path):
    """The real runner, with a sampler that raises on one request's row (as an index of -1 would):
    that request fails with the error, the others in its batch produce their solo tokens, and the
    engine goes on serving."""
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": f"bystander number {i}" for i in range(4)}
    solo = {rid: generate_all(engine, {rid: (prompt, greedy)})[rid] for rid, prompt in prompts.items()}
    sample = engine.runner.sampler.sample_with_logprobs

    def sample_or_raise(logits, params, *rest):
        if any(p.seed == 13 for p in params):
            raise IndexError("index -1 is out of bounds for dimension 1 with size 256")
        return sample(logits, params, *rest)

    engine.runner.sampler.sample_with_logprobs = sample_or_raise
    poison = SamplingParams(max_tokens=10, temperature=0.8, seed=13, ignore_eos=True)
    requests = {**{rid: (p, greedy) for rid, p in prompts.items()}, "poison": ("poison", poison)}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finals[out.request_id] = out
    assert finals["poison"].finish_reason == "error" and "IndexError" in finals["poison"].error
    assert {rid: tokens[rid] for rid in prompts} == solo
    assert generate_all(engine, {"after": ("bystander number 0", greedy)})["after"] == solo["r0"]
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_longer_than_the_step_budget_alone_is_served(model_path, dtype):
    """A prompt of several chunks with nothing else running: its first chunks sample no row, so the
    LM head gets no row at all (it failed with "bad panel_linear arguments" on the CPU kernels). Its
    greedy tokens must equal the same prompt computed in one step."""
    prompt = [5 + (i * 7) % 900 for i in range(300)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens = {}
    for budget in (64, 512):
        engine = LLMEngine(EngineConfig(model=model_path, dtype=dtype, num_threads=1, max_num_batched_tokens=budget))
        engine.add_request("long", prompt, greedy)
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        assert [out.error for out in outputs if out.error] == [], budget
        tokens[budget] = [t for out in outputs for t in out.token_ids]
    assert tokens[64] == tokens[512] and len(tokens[64]) == 4
