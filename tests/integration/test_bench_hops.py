"""bench_hops end to end on the tiny model: every layer of the serving path timed, the report whole."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.integration


def test_every_layer_of_the_path_is_timed_for_every_prompt_size(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from loadtest.benchmarks import bench_hops

    report = bench_hops.main(["--model", tiny_model_dir, "--dtype", "float32", "--prompt-tokens", "3,20",
                              "--requests", "2", "--rounds", "1", "--gap-s", "0"])
    assert set(report["first_token_median_ms"]) == {3, 20}
    for size, runs in report["first_token_runs_ms"].items():
        assert set(runs) == set(bench_hops.LAYERS)
        assert all(len(values) == 2 and all(v > 0 for v in values) for values in runs.values()), (size, runs)
    # The admission chunk comes before the token it confirms.
    for runs in report["first_token_runs_ms"].values():
        assert all(a <= t for a, t in zip(runs["replica_admission"], runs["replica"]))


def test_bad_arguments_are_refused_with_the_reason(capsys):
    from loadtest.benchmarks import bench_hops

    for argv, reason in ((["--prompt-tokens", "4,x"], "comma-separated"), (["--prompt-tokens", "0"], "at least 1"),
                         (["--requests", "0"], "--requests"), (["--gap-s", "-1"], "--gap-s")):
        with pytest.raises(SystemExit):
            bench_hops.parse_args(argv)
        assert reason in capsys.readouterr().err
