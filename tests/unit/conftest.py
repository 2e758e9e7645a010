from __future__ import annotations

import pytest

from model_worker import EngineConfig, LLMEngine
from tests.unit.fakes import FakeClock, FakeKVRunner


@pytest.fixture
def make_engine():
    """Build real engines over a FakeKVRunner; at teardown every block must be back in the pool
    and no request left behind."""
    engines: list[LLMEngine] = []

    def build(num_kv_blocks: int = 256, block_size: int = 4, tokenizer=None, eos_token_ids=(),
              max_model_len: int = 4096, vocab_size: int = 1000, **config) -> LLMEngine:
        runner = FakeKVRunner(num_kv_blocks, block_size, max_model_len, vocab_size, eos_token_ids)
        runner.tokenizer = tokenizer
        engine = LLMEngine(EngineConfig(block_size=block_size, **config), model_runner=runner,
                           tokenizer=tokenizer, clock=FakeClock())
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        scheduler = engine.scheduler
        assert not scheduler.running and not scheduler.waiting and not scheduler.requests, "request left behind"
        assert scheduler.kv.num_free_blocks == scheduler.config.num_kv_blocks, "a KV block was not returned"
        assert all(block.ref_count == 0 for block in scheduler.kv.pool.blocks)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until done; return each request's tokens and the step at which it finished."""
    tokens: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    for step in range(1, max_steps + 1):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished_at[out.request_id] = step
    assert not engine.has_unfinished(), "engine did not finish"
    return {"tokens": tokens, "finished_at": finished_at}
