"""bench_sampling_features on the tiny model: every variant and batch size gets a figure and a
ratio to `none`, and bad arguments are refused."""

from __future__ import annotations

import pytest

from loadtest.benchmarks import bench_sampling_features as bench

pytestmark = pytest.mark.integration


def test_every_variant_is_priced_against_none(tiny_model_dir, capsys):
    result = bench.main(["--model", tiny_model_dir, "--batch-sizes", "1,3", "--steps", "2", "--rounds", "2",
                         "--prompt-tokens", "8"])
    assert set(result["variants"]) == {f"{v}@{b}" for v in bench.VARIANTS for b in (1, 3)}
    for batch in (1, 3):
        assert result["variants"][f"none@{batch}"]["over_none"] == 1.0
    for row in result["variants"].values():
        assert row["step_ms"] > 0 and len(row["rounds_ms"]) == 2
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")


def test_each_variant_asks_for_what_it_names():
    assert bench.params_for("logprobs", 8).logprobs == 5
    assert bench.params_for("penalties", 8).penalises_history
    assert bench.params_for("bias_min_tokens", 8).min_tokens == 8 and bench.params_for("bias_min_tokens", 8).logit_bias
    assert not bench.params_for("none", 8).processes_logits and bench.params_for("none", 8).greedy


@pytest.mark.parametrize("argv", [["--variants", "logprobs"], ["--variants", "none,magic"], ["--steps", "0"],
                                  ["--batch-sizes", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
