"""The benchmark's engine driver, against a fake engine on a fake clock (no torch, no model)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from loadtest.engine_driver import decode_steps_alone, measure_efficiency, run_engine
from loadtest.results import summarize_offline
from loadtest.traces import BenchRequest


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now_s += seconds


@dataclass
class FakeOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


class FakeEngine:
    """Admits up to max_running requests; each step costs step_s of wall time, of which
    forward_share is 'forward', and gives every running request one token."""

    def __init__(self, clock: FakeClock, max_running: int = 4, step_s: float = 0.1, forward_share: float = 0.9,
                 extra_token_for: str | None = None) -> None:
        self.clock, self.max_running, self.step_s, self.forward_share = clock, max_running, step_s, forward_share
        self.waiting: list[tuple[str, int]] = []
        self.running: dict[str, int] = {}  # request id -> tokens still to produce
        self.forward_time_s = 0.0
        self.extra_token_for = extra_token_for
        self.added_at: dict[str, float] = {}

    def add_request(self, request_id, prompt, params) -> None:
        self.added_at[request_id] = self.clock()
        self.waiting.append((request_id, params))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SimpleNamespace:  # the EngineStats fields the driver reads
        return SimpleNamespace(num_running=len(self.running), num_waiting=len(self.waiting),
                               forward_time_s=self.forward_time_s)

    def step(self) -> list[FakeOutput]:
        while self.waiting and len(self.running) < self.max_running:
            rid, n = self.waiting.pop(0)
            self.running[rid] = n + (1 if rid == self.extra_token_for else 0)
        self.clock.now_s += self.step_s
        self.forward_time_s += self.step_s * self.forward_share
        outputs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            done = self.running[rid] == 0
            outputs.append(FakeOutput(rid, [7], done))
            if done:
                del self.running[rid]
        return outputs


def _request(i: int, arrival_s: float, output_tokens: int) -> BenchRequest:
    return BenchRequest(f"r{i}", (1, 2, 3), output_tokens, arrival_s)


def test_records_first_token_and_finish_per_request():
    clock = FakeClock()
    engine = FakeEngine(clock, max_running=4, step_s=0.1)
    records = run_engine(engine, [_request(0, 0.0, 3), _request(1, 0.0, 1)], lambda n: n,
                         clock=clock, sleep=clock.sleep)
    by_id = {r.request_id: r for r in records}
    assert by_id["r0"].ttft_s == pytest.approx(0.1) and by_id["r0"].e2e_s == pytest.approx(0.3)
    assert by_id["r1"].ttft_s == pytest.approx(0.1) and by_id["r1"].e2e_s == pytest.approx(0.1)
    assert summarize_offline(records).useful_tokens_per_s == pytest.approx(4 / 0.3)


def test_requests_are_added_at_their_arrival_and_idle_time_is_slept():
    clock = FakeClock()
    engine = FakeEngine(clock, step_s=0.1)
    records = run_engine(engine, [_request(1, 5.0, 2), _request(0, 0.0, 1)], lambda n: n,
                         clock=clock, sleep=clock.sleep)
    assert engine.added_at == {"r0": 0.0, "r1": pytest.approx(5.0)}
    late = next(r for r in records if r.request_id == "r1")
    assert late.ttft_s == pytest.approx(0.1)  # latency counts from its arrival, not from t=0
    assert late.finish_s == pytest.approx(5.2)


def test_queueing_delay_counts_against_ttft():
    clock = FakeClock()
    engine = FakeEngine(clock, max_running=1, step_s=0.1)
    records = run_engine(engine, [_request(0, 0.0, 2), _request(1, 0.0, 2)], lambda n: n,
                         clock=clock, sleep=clock.sleep)
    second = next(r for r in records if r.request_id == "r1")
    assert second.ttft_s == pytest.approx(0.3)


def test_wrong_output_length_is_an_error():
    clock = FakeClock()
    engine = FakeEngine(clock, extra_token_for="r0")
    with pytest.raises(RuntimeError, match="wrong number of tokens"):
        run_engine(engine, [_request(0, 0.0, 2)], lambda n: n, clock=clock, sleep=clock.sleep)


def test_efficiency_counts_only_steps_with_all_requests_running():
    clock = FakeClock()
    # Room for 4 only: 6 never run at once, so there is no window to measure.
    engine = FakeEngine(clock, max_running=4, step_s=0.01, forward_share=0.8)
    pool = np.arange(10, 50)
    with pytest.raises(RuntimeError, match="never had 6"):
        measure_efficiency(engine, lambda n: n, pool, num_seqs=6, prompt_tokens=4, max_tokens=5, clock=clock)

    clock = FakeClock()
    engine = FakeEngine(clock, max_running=8, step_s=0.01, forward_share=0.8)
    result = measure_efficiency(engine, lambda n: n, pool, num_seqs=6, prompt_tokens=4, max_tokens=5, clock=clock)
    # First step starts with 6 waiting (outside the window); the next 4 have all 6 running.
    assert result.num_steps == 4
    assert result.num_tokens == 24
    assert result.efficiency == pytest.approx(0.8)


class PromptStepEngine(FakeEngine):
    """A FakeEngine whose first step is a prompt step: 0.5 s and no token."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, step_s=0.1)
        self.prompt_done = False

    def step(self) -> list[FakeOutput]:
        if not self.prompt_done:
            self.prompt_done = True
            self.clock.now_s += 0.5
            return []
        return super().step()


def test_a_lone_request_counts_only_the_steps_after_its_first_token():
    clock = FakeClock()
    engine = PromptStepEngine(clock)
    steps = decode_steps_alone(engine, "alone", [1, 2, 3], 4, clock=clock)
    # Prompt step (no token), first token, then three decode steps of 0.1 s each.
    assert steps == pytest.approx([0.1, 0.1, 0.1]) and not engine.has_unfinished()
    assert engine.added_at == {"alone": 0.0}
