"""Stall-free batching: a step beside running decodes carries only the prompt tokens it can afford."""

from __future__ import annotations

import pytest

from model_worker import SamplingParams
from model_worker.sched.step_budget import MIN_SAMPLE_TOKENS, StepBudget
from tests.unit.conftest import run_to_completion
from tests.unit.fakes import reference_tokens

DECODE_S = 0.040  # a pure decode step, whatever the batch (the fake runner's cost model)
TOKEN_S = 0.002  # what a prompt token adds to a step


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 900 for i in range(n)]


def test_the_whole_budget_until_both_costs_are_measured_and_when_nothing_decodes():
    budget = StepBudget(512, max_slowdown=2.0, min_tokens=16)
    assert budget.prompt_tokens(4) == 508, "nothing measured yet: the budget less the decodes"
    budget.record(4, 0, DECODE_S)
    assert budget.prompt_tokens(4) == 508, "a token's cost not measured yet"
    budget.record(4, 100, DECODE_S + 100 * TOKEN_S)
    assert budget.prompt_tokens(4) == pytest.approx(DECODE_S / TOKEN_S, abs=1)  # (2 - 1) * D / c = 20
    assert budget.prompt_tokens(0) == 512, "an idle engine prefills at full size"
    assert StepBudget(512, None, 16).prompt_tokens(4) == 508


def test_the_slowdown_scales_the_chunk_and_the_floor_and_ceiling_hold():
    budget = StepBudget(512, max_slowdown=3.0, min_tokens=16)
    budget.record(1, 0, DECODE_S)
    budget.record(1, 200, DECODE_S + 200 * TOKEN_S)
    assert budget.prompt_tokens(1) == pytest.approx(2 * DECODE_S / TOKEN_S, abs=1)
    budget.record(1, 200, DECODE_S + 200 * 0.1)  # tokens suddenly dear: the chunk shrinks, never below 16
    for _ in range(30):
        budget.record(1, 200, DECODE_S + 200 * 0.1)
    assert budget.prompt_tokens(1) == 16
    cheap = StepBudget(64, max_slowdown=2.0, min_tokens=16)
    cheap.record(1, 0, DECODE_S)
    cheap.record(1, 100, DECODE_S + 100 * 1e-6)
    assert cheap.prompt_tokens(1) == 63, "the token budget less the decode"


def test_each_prompt_in_flight_gets_a_share_so_a_burst_is_not_prefilled_k_times_slower():
    budget = StepBudget(512, max_slowdown=2.0, min_tokens=16)
    budget.record(4, 0, DECODE_S)
    budget.record(4, 100, DECODE_S + 100 * TOKEN_S)
    one = budget.prompt_tokens(4, num_prompts=1)
    assert budget.prompt_tokens(4, num_prompts=3) == pytest.approx(3 * one, abs=2)
    assert budget.prompt_tokens(4, num_prompts=100) == 508, "never past the token budget"


def test_small_prompt_steps_and_zero_times_teach_nothing():
    budget = StepBudget(512, max_slowdown=2.0, min_tokens=16)
    budget.record(2, 0, DECODE_S)
    budget.record(2, MIN_SAMPLE_TOKENS - 1, 5.0)
    budget.record(2, 100, 0.0)
    assert budget.prompt_token_s is None


class TimedRunner:
    """The fake runner, with the engine's clock advanced by what the step would cost."""

    def __init__(self, runner, clock) -> None:
        self.runner, self.clock = runner, clock

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        prompt_tokens = sum(len(seq.token_ids) for seq in batch.sequences if len(seq.token_ids) > 1)
        self.clock.advance(DECODE_S + TOKEN_S * prompt_tokens)
        return self.runner.execute(batch)


def timed(engine):
    engine.runner = TimedRunner(engine.runner, engine.clock)
    return engine


def test_decodes_never_wait_behind_a_prompt_beyond_the_slowdown(make_engine):
    engine = timed(make_engine(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=512, max_decode_slowdown=2.0))
    for i in range(4):
        engine.add_request(f"d{i}", prompt(40, i), greedy(60))
    engine.step()  # an idle engine: the four prompts in one step
    assert engine.runner.batches[-1].num_scheduled_tokens == 160
    engine.add_request("warm", prompt(100, 50), greedy(2))  # the first mixed step measures a token's cost
    for _ in range(3):
        engine.step()
    engine.add_request("long", prompt(300, 99), greedy(4))
    first = len(engine.runner.batches)
    while "long" not in {s.request_id for s in engine.runner.batches[-1].sequences if s.sample}:
        engine.step()
    steps = engine.runner.batches[first:]
    for batch in steps:
        decodes = [s for s in batch.sequences if s.request_id.startswith("d")]
        assert len(decodes) == 4 and all(len(s.token_ids) == 1 for s in decodes), "every decode ran"
        prompt_tokens = batch.num_scheduled_tokens - len(decodes)
        assert DECODE_S + TOKEN_S * prompt_tokens <= 2.0 * DECODE_S * 1.05, "a step took over twice a decode step"
    assert len(steps) >= 300 // (DECODE_S / TOKEN_S), "the prompt went in affordable chunks"
    result = run_to_completion(engine)
    assert result["tokens"]["long"][-3:] == reference_tokens(prompt(300, 99), 4)[-3:]


@pytest.mark.parametrize("slowdown", [2.0, None])
def test_a_prefill_ahead_in_the_running_order_does_not_starve_the_decodes_behind_it(make_engine, slowdown):
    """An interactive prompt that arrives while a batch request decodes runs ahead of it in the
    running order; it takes the prompt budget, and the decode behind it still gets its token in
    every step (before, the prompt took the whole token budget and the decode waited)."""
    engine = timed(make_engine(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=256,
                               max_decode_slowdown=slowdown))
    engine.add_request("batch", prompt(20, 8), greedy(200), priority="batch")
    engine.add_request("warm", prompt(100, 50), greedy(2), priority="batch")
    for _ in range(4):
        engine.step()
    engine.add_request("urgent", prompt(1500, 7), greedy(3))
    log = []
    while "urgent" in engine.scheduler.requests:
        engine.step()
        log.append({s.request_id: len(s.token_ids) for s in engine.runner.batches[-1].sequences})
    # (2 - 1) * D / c = 20 tokens, learnt from the steps so far (the first estimate, made before any
    # decode step was timed, is high, so the first chunks are a little smaller)
    chunks = [step["urgent"] for step in log if step["urgent"] > 1]
    assert sum(chunks) in (1499, 1500)
    if slowdown is None:
        assert chunks[:-1] == [255] * (len(chunks) - 1), "the token budget less the decode's token"
    else:
        assert all(16 <= chunk <= 20 for chunk in chunks[:-1]), "chunks the step affords"
    assert all(step.get("batch") == 1 for step in log), "the batch request decoded in every step"
    run_to_completion(engine)


def test_an_idle_engine_prefills_a_lone_prompt_whole(make_engine):
    """A lone request's TTFT is what it was: with nothing decoding, the prompt fills the budget."""
    engine = timed(make_engine(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=512, max_decode_slowdown=2.0))
    engine.add_request("a", prompt(50, 1), greedy(20))
    engine.add_request("b", prompt(100, 2), greedy(2))
    run_to_completion(engine)
    engine.add_request("lone", prompt(400, 3), greedy(2))
    engine.step()
    assert engine.runner.batches[-1].num_scheduled_tokens == 400
    run_to_completion(engine)


def test_off_by_default_prompts_fill_the_token_budget(make_engine):
    engine = timed(make_engine(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=512))
    assert engine.scheduler.config.max_decode_slowdown is None
    engine.add_request("a", prompt(40, 1), greedy(30))
    engine.add_request("warm", prompt(100, 2), greedy(2))
    for _ in range(4):
        engine.step()
    engine.add_request("long", prompt(300, 3), greedy(2))
    engine.step()
    assert engine.runner.batches[-1].num_scheduled_tokens == 301, "the whole prompt beside the decode"
    run_to_completion(engine)


@pytest.mark.parametrize("value", [0.5, 0, -1, "2", float("nan"), True])
def test_a_bad_slowdown_is_refused(value):
    from model_worker.config import EngineConfig

    with pytest.raises(ValueError, match="max_decode_slowdown"):
        EngineConfig(max_decode_slowdown=value)
