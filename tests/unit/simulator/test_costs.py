"""simulator.validation.costs: each figure is the timed work divided by the work counted.

The timer here is driven by the work itself: it reads a count of simulated steps (or routing
decisions) times a fixed cost, so every figure is known exactly and nothing depends on how fast
this machine runs.
"""

from __future__ import annotations

import json

import pytest

from router.policy import RouterConfig, make_policy
from simulator.cli import load_step_model
from simulator.validation import costs

PROFILE = "llama3-8b-h100"
STEP_WALL_S = 0.004  # what one simulated step "costs" on the work-driven timer
DECISION_WALL_S = 0.002


class CountingStepModel:
    """The real step-time model, counting the steps it is asked to time."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.steps = 0

    def predict(self, batch) -> float:
        self.steps += 1
        return self.inner.predict(batch)


class CountingPolicy:
    """The real prefix-aware policy, counting its decisions and keeping what it chose over what."""

    def __init__(self) -> None:
        self.inner = make_policy(RouterConfig(policy="prefix_aware"))
        self.decisions = 0
        self.table_sizes: set[int] = set()
        self.chosen: set[str] = set()

    def choose(self, table, hits, num_blocks, blocks_needed) -> str:
        self.decisions += 1
        self.table_sizes.add(len(table))
        choice = self.inner.choose(table, hits, num_blocks, blocks_needed)
        self.chosen.add(choice)
        return choice


def args(*argv: str):
    return costs.parse_args(["--repeats", "2", *argv])


def decode_figure(batch: int, decode_tokens: int) -> tuple[float, float]:
    """(the decode figure, simulated steps per run) for one size."""
    model = CountingStepModel(load_step_model(PROFILE))
    figure = costs.decode_us_per_token(args("--batch", str(batch), "--decode-tokens", str(decode_tokens)), model,
                                       timer=lambda: model.steps * STEP_WALL_S)
    return figure, model.steps / 2


def test_the_decode_figure_is_the_runs_time_over_the_tokens_it_decoded():
    figure, steps = decode_figure(batch=2, decode_tokens=20)
    assert figure == pytest.approx(steps * STEP_WALL_S / (2 * 20) * 1e6)
    # Four times the tokens: about four times the steps, the same cost per token; twice the
    # batch decodes two tokens a step, so each costs about half.
    longer, longer_steps = decode_figure(batch=2, decode_tokens=80)
    assert 3.5 * steps <= longer_steps <= 4 * steps
    assert longer == pytest.approx(figure, rel=0.15)
    wider, _ = decode_figure(batch=4, decode_tokens=20)
    assert wider == pytest.approx(figure / 2, rel=0.15)


def test_the_request_figure_is_the_runs_time_over_its_requests():
    model = CountingStepModel(load_step_model(PROFILE))
    figure = costs.request_ms(args("--requests", "20"), model, timer=lambda: model.steps * STEP_WALL_S)
    steps = model.steps / 2
    assert steps > 20
    assert figure == pytest.approx(steps * STEP_WALL_S / 20 * 1e3)


@pytest.mark.parametrize("num_replicas", [1, 1000])
def test_the_route_figure_is_the_time_of_each_decision_over_the_whole_table(num_replicas):
    policy = CountingPolicy()
    figure = costs.route_us(args("--decisions", "30"), num_replicas, timer=lambda: policy.decisions * DECISION_WALL_S,
                            policy=policy)
    assert policy.decisions == 2 * 30
    assert figure == pytest.approx(DECISION_WALL_S * 1e6)
    assert policy.table_sizes == {num_replicas}
    # Loads are alike and no replica is short of blocks: the one holding the prefix wins.
    assert policy.chosen == {"r0000"}


def test_a_figure_is_the_best_of_its_repeats():
    readings = iter([3.0, 1.0, 2.0])
    assert costs.best_of(3, lambda: next(readings)) == 1.0


def test_costs_prints_every_figure_as_its_last_line(capsys):
    result = costs.main(["--repeats", "1", "--batch", "2", "--decode-tokens", "20", "--requests", "20",
                         "--decisions", "10"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert set(result) == {"repeats", "batch", "decode_us_per_token", "request_ms_1_replica", "route_us_1_replicas",
                           "route_us_64_replicas", "route_us_1000_replicas"}


def test_costs_refuses_sizes_below_one():
    with pytest.raises(SystemExit, match="--requests must be >= 1"):
        costs.parse_args(["--requests", "0"])
