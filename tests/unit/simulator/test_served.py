"""The pure parts of the served validation: the padded step model, errors, rankings, configs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from model_worker.config import EngineConfig

from loadtest.results import summarize
from simulator.cluster import SimCluster
from loadtest.results import RequestResult
from simulator.validation.served import (PaddedStepModel, autoscaler_config, cluster_config, compare, itl_p99, max_rel_error,
                                 overhead_gap, parse_args, ranking, rankings_agree, real_spread, seed_spread)
from loadtest.traces import BenchRequest


class Forward:
    """A forward taking a known time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict(self, batch) -> float:
        return self.seconds


class Batch:
    def __init__(self, num_sequences: int) -> None:
        self.sequences = [object()] * num_sequences


def test_padded_step_lasts_the_pad_or_the_forward_whichever_is_longer():
    assert PaddedStepModel(Forward(0.004), 0.05).predict(Batch(3)) == 0.05
    assert PaddedStepModel(Forward(0.08), 0.05).predict(Batch(1)) == 0.08
    # PaddedRunner pads only steps with sequences.
    assert PaddedStepModel(Forward(0.004), 0.05).predict(Batch(0)) == 0.0
    with pytest.raises(ValueError):
        PaddedStepModel(Forward(0.0), -1.0)


def test_padded_steps_set_a_simulated_requests_tpot():
    config = cluster_config({"model": "tiny", "engine_args": {"num_kv_blocks": 64}}, 2048)
    prompt = tuple(range(1, 33))
    run = SimCluster(config, PaddedStepModel(Forward(0.001), 0.05)).run([BenchRequest("a", prompt, 11, 0.0)])
    result = run.results[0]
    assert result.status == 200 and result.tpot_s == pytest.approx(0.05)
    assert result.ttft_s == pytest.approx(0.05)


def test_errors_are_relative_to_the_real_figure_and_the_largest_is_reported():
    a = compare({"ttft_p50_s": 0.1, "tpot_p50_s": 0.05}, {"ttft_p50_s": 0.12, "tpot_p50_s": 0.05})
    b = compare({"ttft_p50_s": 0.2, "tpot_p50_s": None}, {"ttft_p50_s": 0.1, "tpot_p50_s": 0.05})
    assert a["rel_error"]["ttft_p50_s"] == pytest.approx(0.2) and a["rel_error"]["tpot_p50_s"] == 0.0
    assert b["rel_error"]["tpot_p50_s"] is None  # no real figure: no error, not an infinite one
    assert max_rel_error({"a": a, "b": b}) == pytest.approx(0.5)
    assert max_rel_error({}) is None


def test_rankings_order_lower_ttft_and_higher_hit_rate_first():
    assert ranking({"pa": 0.1, "pow2": 0.3, "rr": 0.2}, higher_is_better=False) == ["pa", "rr", "pow2"]
    assert ranking({"pa": 0.9, "pow2": 0.3, "rr": 0.4}, higher_is_better=True) == ["pa", "rr", "pow2"]


def test_rankings_agree_on_the_pairs_the_real_run_separates():
    real = {"pa": 0.10, "pow2": 0.30, "rr": 0.31}
    # pow2 and rr are within 5% in the real run: either order is fine.
    assert rankings_agree(real, {"pa": 0.12, "pow2": 0.35, "rr": 0.33}, False, tie_rel=0.05)
    # The best policy swapped: not the same ranking.
    assert not rankings_agree(real, {"pa": 0.40, "pow2": 0.35, "rr": 0.33}, False, tie_rel=0.05)
    # Without a tie tolerance every order counts.
    assert not rankings_agree(real, {"pa": 0.12, "pow2": 0.35, "rr": 0.33}, False)
    hits = {"pa": 0.8, "pow2": 0.40, "rr": 0.41}
    assert rankings_agree(hits, {"pa": 0.7, "pow2": 0.45, "rr": 0.44}, True, tie_abs=0.02)
    assert not rankings_agree(hits, {"pa": 0.4, "pow2": 0.45, "rr": 0.44}, True, tie_abs=0.02)
    # A simulated tie where the real run separates two policies is not agreement.
    assert not rankings_agree(hits, {"pa": 0.45, "pow2": 0.45, "rr": 0.44}, True, tie_abs=0.02)


def test_calibrated_costs_are_the_real_excess_never_negative():
    assert overhead_gap(0.056, 0.05) == pytest.approx(0.006)
    assert overhead_gap(0.04, 0.05) == 0.0
    with pytest.raises(ValueError):
        overhead_gap(None, 0.05)


def test_cluster_config_takes_the_deployments_limits_router_and_admission():
    app = {"model": "tiny", "num_replicas": 3, "routing_stats_period_s": 0.5,
           "engine_args": {"num_kv_blocks": 320, "max_num_seqs": 4, "emulated_step_time_s": 0.05},
           "router": {"policy": "pow2", "dispatch_ttl_s": 4.0}, "admission": {"max_waiting_requests": 7}}
    config = cluster_config(app, 2048, step_overhead_s=0.002)
    limits = config.scheduler
    assert (limits.num_kv_blocks, limits.max_num_seqs, config.num_replicas) == (320, 4, 3)
    defaults = EngineConfig()
    assert (limits.block_size, limits.max_num_batched_tokens, limits.max_model_len) == \
        (defaults.block_size, defaults.max_num_batched_tokens, 2048)
    assert config.router.policy == "pow2" and config.dispatch_ttl_s == 4.0
    assert config.routing_stats_period_s == 0.5 and config.admission == {"max_waiting_requests": 7}
    assert config.step_overhead_s == 0.002
    with pytest.raises(ValueError):  # a cache sized from memory cannot be simulated
        cluster_config({"model": "tiny"}, 2048)
    scaling = autoscaler_config({"min_replicas": 1, "max_replicas": 3, "initial_replicas": 1, "ttft_slo_s": 0.5})
    assert (scaling.max_replicas, scaling.ttft_slo_s) == (3, 0.5)


def test_a_random_policys_spread_over_seeds_says_whether_the_real_run_lies_in_it():
    app = {"model": "tiny", "num_replicas": 3, "engine_args": {"num_kv_blocks": 64, "max_num_seqs": 2},
           "router": {"policy": "pow2"}}
    workload = [BenchRequest(f"r{i}", tuple(range(1 + i, 33 + i)), 8, 0.01 * i) for i in range(30)]
    model = PaddedStepModel(Forward(0.001), 0.05)
    sims = [SimCluster(cluster_config(app, 2048, seed=seed), model).run(workload) for seed in range(6)]
    p99s = sorted(summarize(run.results)["ttft_s"]["p99"] for run in sims)
    assert p99s[0] < p99s[-1]  # the draws matter: a spread, not one value
    real = {"ttft_p50_s": None, "ttft_p99_s": (p99s[0] + p99s[-1]) / 2, "tpot_p50_s": 1.0,
            "output_tokens_per_s": 1e9}
    spread = seed_spread(lambda seed: cluster_config(app, 2048, seed=seed), model, workload, real, 2.0, seeds=6)
    assert spread["range"]["ttft_p99_s"] == [pytest.approx(p99s[0]), pytest.approx(p99s[-1])]
    assert spread["within"] == {"ttft_p50_s": False, "ttft_p99_s": True, "tpot_p50_s": False,
                                "output_tokens_per_s": False, "hit_rate": False}


def test_importing_the_module_imports_neither_torch_nor_ray():
    code = "import sys, simulator.validation.served; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]



def test_repeated_real_runs_give_a_range_and_say_whether_the_simulated_figure_lies_inside():
    runs = [{"ttft_p99_s": 2.9, "tpot_p50_s": 0.1}, {"ttft_p99_s": 4.0, "tpot_p50_s": None},
            {"ttft_p99_s": 3.5, "tpot_p50_s": 0.1}]
    out = real_spread(runs, {"ttft_p99_s": 3.0, "tpot_p50_s": 0.2})
    assert out["runs"] == 3
    assert out["range"] == {"ttft_p99_s": [2.9, 4.0], "tpot_p50_s": [0.1, 0.1]}
    assert out["sim_within"] == {"ttft_p99_s": True, "tpot_p50_s": False}


def test_itl_p99_counts_every_gap_of_answered_requests_only():
    ok = RequestResult("a", sent_s=0.0, status=200, output_tokens=4, first_token_s=0.1,
                       chunk_times_s=[0.1, 0.2, 0.3, 1.3], finish_s=1.3)
    failed = RequestResult("b", sent_s=0.0, status=500, error="boom", chunk_times_s=[0.0, 50.0])
    assert itl_p99([ok, failed]) == pytest.approx(float(__import__("numpy").quantile([0.1, 0.1, 1.0], 0.99)))
    assert itl_p99([failed]) is None


@pytest.mark.parametrize("argv, says", [(["--parts", "trace,bogus"], "['bogus']"), (["--parts", ","], "got nothing"),
                                        (["--real-repeats", "0"], "--real-repeats must be >= 1")])
def test_bad_parts_or_repeats_are_refused_with_a_clear_error(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err


def test_parts_and_repeats_parse():
    args = parse_args(["--parts", "multi_turn, autoscale", "--real-repeats", "3"])
    assert args.parts == ["multi_turn", "autoscale"] and args.real_repeats == 3
