"""bench_matmuls: its flags are checked, and a small run times both paths on every row count."""

from __future__ import annotations

import pytest
import torch

from loadtest.benchmarks import bench_matmuls
from model_worker.runner.cpu_kernels import ops

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("argv, message", [(["--rows", "0,4"], "must be positive"),
                                           (["--dtypes", "float16"], "is not one of"),
                                           (["--turns", "0"], "must be positive")])
def test_bad_flags_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_matmuls.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_small_run_times_both_paths_at_every_row_count():
    if ops.kernels() is None or not ops.has_panel_linear(torch.float32):
        pytest.skip("panel_linear does not run float32 here")
    report = bench_matmuls.main(["--rows", "1,3", "--layers", "1", "--turns", "1", "--passes", "1"])
    figures = report["ms_per_pass"]["float32"]
    assert set(figures) == {"1", "3"}
    for row in figures.values():
        assert row["panels"] > 0 and row["onednn"] > 0
        assert row["panels_over_onednn"] == pytest.approx(row["panels"] / row["onednn"])
