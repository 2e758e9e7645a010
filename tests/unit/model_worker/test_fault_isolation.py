"""A step that raises fails only the requests that caused it.

The real scheduler, block pool and engine over FakeKVRunner, whose tokens depend on every KV slot
it reads: a survivor that read a half-written block, or a later request that hit one in the
prefix cache, gets wrong tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from model_worker import AsyncLLMEngine, EngineConfig, EngineDeadError, LLMEngine, RequestFailed, SamplingParams
from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.engine.llm_engine import MAX_RUNNER_FAILURES_IN_A_ROW, EngineBroken
from model_worker.engine.fault_isolation import execute_isolating
from tests.unit.fakes import ByteTokenizer, FakeKVRunner, reference_tokens

BLOCK = 4


class PoisonRunner(FakeKVRunner):
    """Raises on any batch holding a poisoned request, after writing garbage into that request's
    slots (as a kernel that faults half way would). `broken_calls` fails every call, probe too."""

    def __init__(self, *args, poisoned=(), broken_calls=0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poisoned = set(poisoned)
        self.broken_calls = broken_calls
        self.attempts: list[SchedulerOutput] = []

    def execute(self, batch: SchedulerOutput) -> list[int]:
        self.attempts.append(batch)
        if self.broken_calls:
            self.broken_calls -= 1
            raise RuntimeError("device lost")
        bad = [seq for seq in batch.sequences if seq.request_id in self.poisoned]
        for seq in bad:
            for offset in range(len(seq.token_ids)):
                self.slots[self._slot(seq.block_table, seq.start_position + offset)] = -1
        if bad:
            raise IndexError(f"index -1 is out of bounds ({bad[0].request_id})")
        return super().execute(batch)


def make_engine(num_kv_blocks=256, tokenizer=None, **runner_kwargs) -> LLMEngine:
    runner = PoisonRunner(num_kv_blocks, BLOCK, **runner_kwargs)
    return LLMEngine(EngineConfig(block_size=BLOCK, max_num_batched_tokens=256), model_runner=runner,
                     tokenizer=tokenizer)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, requests: dict[str, list[int]], max_tokens: int = 6):
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, greedy(max_tokens))
    tokens = {rid: [] for rid in requests}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


def assert_pool_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks


def test_a_poisoned_request_fails_alone_and_its_batch_goes_on():
    engine = make_engine(poisoned={"poison"})
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(7)}
    tokens, finals = run(engine, {**prompts, "poison": [7, 8, 9, 10, 11, 12]})
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == reference_tokens(prompt, 6)
        assert finals[request_id].finish_reason == "length"
    assert finals["poison"].finish_reason == "error" and "IndexError" in finals["poison"].error
    assert tokens["poison"] == []
    assert engine.stats().requests_finished["error"] == 1
    assert_pool_idle(engine)


def test_blocks_a_failed_step_wrote_leave_the_prefix_cache():
    """The poisoned prefill registered its blocks in the prefix cache, then wrote garbage into them:
    a later request with the same prompt must recompute them, not hit them."""
    prompt = list(range(100, 117))  # 4 full blocks and one token
    engine = make_engine(poisoned={"poison"})
    _, finals = run(engine, {"poison": prompt})
    assert finals["poison"].finish_reason == "error"
    tokens, _ = run(engine, {"clean": prompt})
    assert tokens["clean"] == reference_tokens(prompt, 6)
    assert_pool_idle(engine)


def test_a_survivor_that_hit_a_culprits_block_in_the_same_step_is_recomputed():
    """`same` is admitted in the step where `poison` fills the blocks it hits: it read garbage
    and must be recomputed rather than keep the token it sampled from it."""
    prompt = list(range(200, 213))
    engine = make_engine(poisoned={"poison"})
    tokens, finals = run(engine, {"poison": prompt, "same": prompt + [300, 301]})
    assert engine.runner.attempts[0].sequences[1].start_position > 0, "the test needs a same-step prefix hit"
    assert finals["poison"].finish_reason == "error"
    assert tokens["same"] == reference_tokens(prompt + [300, 301], 6)
    assert_pool_idle(engine)


def test_two_culprits_among_many_are_both_found():
    engine = make_engine(poisoned={"p1", "p2"})
    prompts = {f"r{i}": [3 + i, 4 + i, 5 + i] for i in range(14)}
    tokens, finals = run(engine, {"p1": [1000 % 997, 5], **prompts, "p2": [9, 9, 9]})
    assert {rid for rid, out in finals.items() if out.finish_reason == "error"} == {"p1", "p2"}
    assert all(tokens[rid] == reference_tokens(p, 6) for rid, p in prompts.items())
    assert_pool_idle(engine)


def test_a_transient_runner_failure_blames_nobody():
    """The whole step and the probe fail once (a device hiccup): every request is recomputed and
    finishes with exactly its tokens; nobody gets an error."""
    engine = make_engine(broken_calls=2)
    prompts = {f"r{i}": [50 + i, 60 + i, 70 + i] for i in range(5)}
    tokens, finals = run(engine, prompts)
    assert all(tokens[rid] == reference_tokens(p, 6) for rid, p in prompts.items())
    assert all(out.finish_reason == "length" for out in finals.values())
    assert engine.num_runner_failures == 1 and engine.num_runner_failures_in_a_row == 0
    assert_pool_idle(engine)


def test_a_runner_that_keeps_failing_breaks_the_engine_instead_of_blaming_requests():
    engine = make_engine(broken_calls=10**9)
    engine.add_request("a", [5, 6, 7], greedy(4))
    engine.add_request("b", [8, 9, 10], greedy(4))
    for _ in range(MAX_RUNNER_FAILURES_IN_A_ROW - 1):
        assert engine.step() == []  # requeued, nobody failed
    assert engine.stats().num_waiting == 2
    with pytest.raises(EngineBroken, match="in a row"):
        engine.step()


def test_async_engine_reports_the_culprit_and_keeps_serving():
    engine = AsyncLLMEngine(engine=make_engine(poisoned={"poison"}))

    async def collect(request_id, prompt):
        tokens = []
        async for out in engine.generate(prompt, greedy(6), request_id=request_id):
            tokens += out.token_ids
        return tokens

    async def main():
        results = await asyncio.gather(collect("poison", [4, 4, 4]), collect("ok", [5, 5, 5]),
                                       return_exceptions=True)
        assert isinstance(results[0], RequestFailed) and "IndexError" in str(results[0])
        assert results[1] == reference_tokens([5, 5, 5], 6)
        assert engine.is_running
        assert await collect("after", [6, 6, 6]) == reference_tokens([6, 6, 6], 6)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_async_engine_dies_loudly_when_the_runner_is_broken():
    engine = AsyncLLMEngine(engine=make_engine(broken_calls=10**9))

    async def main():
        with pytest.raises(EngineDeadError, match="in a row"):
            async for _ in engine.generate([5, 6, 7], greedy(4)):
                pass
        assert not engine.is_running

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


class RaisingTokenizer(ByteTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        if 258 in ids:
            raise ValueError("cannot decode token 258")
        return super().decode(ids, skip_special_tokens)


def test_a_token_the_tokenizer_cannot_decode_fails_only_its_request():
    engine = make_engine(tokenizer=RaisingTokenizer(), vocab_size=258)  # tokens 3..257: one byte each
    engine.runner.forced[("bad", 2)] = 258
    tokens, finals = run(engine, {"bad": [40, 41, 42], "good": [43, 44, 45]})
    assert finals["bad"].finish_reason == "error" and "cannot decode token 258" in finals["bad"].error
    assert finals["good"].finish_reason == "length"
    assert tokens["good"] == reference_tokens([43, 44, 45], 6, vocab_size=258)
    assert_pool_idle(engine)


def test_bisection_runs_few_forwards():
    """One culprit among 64 costs about 2 log2(64) extra forwards, not 64."""
    calls = []

    def execute(batch):
        calls.append(len(batch.sequences))
        if any(seq.request_id == "x37" for seq in batch.sequences):
            raise ValueError("bad row")
        return [1] * batch.num_sampling

    seqs = [ScheduledSequence(f"x{i}", [1], 0, [i], True, SamplingParams()) for i in range(64)]
    result = execute_isolating(execute, SchedulerOutput(sequences=seqs, num_scheduled_tokens=64), lambda: None)
    assert [seq.request_id for seq, _ in result.culprits] == ["x37"]
    assert [seq.request_id for seq in result.batch.sequences] == [f"x{i}" for i in range(64) if i != 37]
    assert len(result.sampled) == 63 and result.runner_error is None
    assert len(calls) <= 1 + 2 * 6
