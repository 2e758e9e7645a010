"""PaddedRunner: benchmark step padding lives around the runner, not in the engine's step."""

from __future__ import annotations

from model_worker import EngineConfig, LLMEngine, SamplingParams
from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.engine.step_padding import PaddedRunner
from tests.unit.fakes import FakeClock, FakeKVRunner


def one_token_batch() -> SchedulerOutput:
    seq = ScheduledSequence(request_id="r", token_ids=[1, 2, 3], start_position=0, block_table=[0], sample=True,
                            sampling_params=SamplingParams(max_tokens=1), output_index=0)
    return SchedulerOutput(sequences=[seq], num_scheduled_tokens=3)


def test_each_step_sleeps_out_the_rest_of_the_step_time_and_an_empty_one_does_not():
    clock, slept = FakeClock(), []
    inner = FakeKVRunner(8, 4)
    original = inner.execute
    inner.execute = lambda batch: (clock.advance(0.03), original(batch))[1]  # the forward takes 30 ms
    runner = PaddedRunner(inner, 0.1, clock=clock, sleep=slept.append)
    assert len(runner.execute(one_token_batch())) == 1
    assert len(slept) == 1 and abs(slept[0] - 0.07) < 1e-9
    runner.execute(SchedulerOutput())
    assert len(slept) == 1


def test_it_is_a_whole_model_runner_and_the_engine_wraps_its_runner_only_when_asked():
    inner = FakeKVRunner(16, 4, max_model_len=512, vocab_size=300, eos_token_ids=(7,))
    padded = PaddedRunner(inner, 0.05)
    assert (padded.num_kv_blocks, padded.max_model_len, padded.vocab_size, tuple(padded.eos_token_ids)) == \
        (16, 512, 300, (7,))
    assert padded.load_times_s is inner.load_times_s and padded.forward_time_s == 0.0
    assert isinstance(LLMEngine(EngineConfig(block_size=4, emulated_step_time_s=0.05), model_runner=inner).runner,
                      PaddedRunner)
    assert LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(16, 4)).runner.__class__ is FakeKVRunner
