"""bench_attention end to end on small shapes: both builds timed and checked, the report whole."""

from __future__ import annotations

import pytest

from model_worker.runner.cpu_kernels import ops

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(ops.kernels() is None, reason="the CPU kernels do not build here")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_case_is_timed_and_checked_on_both_builds(dtype):
    from loadtest.benchmarks import bench_attention

    if not ops.prefill_attention_built(64):
        pytest.skip("prefill_attention's fast path needs AVX-512")
    report = bench_attention.main(["--before", "HEAD", "--dtype", dtype, "--prompt-tokens", "40",
                                   "--decode", "2x50", "--layers", "2", "--repeats", "2"])
    assert set(report["ms_median"]) == {"prompt_40", "decode_2x50"}
    for name, runs in report["ms_runs"].items():
        assert set(runs) == {"before", "this"} and all(len(v) == 2 and min(v) > 0 for v in runs.values()), name
        assert report["before_over_this"][name] > 0
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for name, errors in report["max_error_vs_float64"].items():
        assert set(errors) == ({"before", "this", "torch_sdpa"} if dtype == "bfloat16" else {"before", "this"})
        assert max(errors.values()) < tolerance, (name, errors)
    assert report["prompt_gflops"]["prompt_40"]["this"] > 0


def test_blocks_in_order_are_timed_and_checked():
    import torch

    from loadtest.benchmarks import bench_attention

    if not ops.prefill_attention_built(64):
        pytest.skip("prefill_attention's fast path needs AVX-512")
    report = bench_attention.main(["--block-order", "in-order", "--prompt-tokens", "40", "--decode", "2x50",
                                   "--layers", "2", "--repeats", "1"])
    assert report["block_order"] == "in-order" and set(report["ms_median"]) == {"prompt_40", "decode_2x50"}
    assert all(max(errors.values()) < 2e-2 for errors in report["max_error_vs_float64"].values())  # bfloat16
    case = bench_attention.DecodeCase(2, 50, 1, (9, 3, 64), torch.bfloat16, seed=1, in_order=True)
    assert case.tables.reshape(-1).tolist() == list(range(case.tables.size))


def test_bad_arguments_are_refused_with_the_reason(capsys):
    from loadtest.benchmarks import bench_attention

    for argv, reason in ((["--heads", "9,2,64"], "multiple"), (["--decode", "4x"], "integers"),
                         (["--prompt-tokens", "0"], "at least 1"), (["--layers", "0"], "--layers"),
                         (["--block-order", "sorted"], "--block-order")):
        with pytest.raises(SystemExit):
            bench_attention.parse_args(argv)
        assert reason in capsys.readouterr().err


def test_an_unknown_revision_is_refused():
    from loadtest.benchmarks import bench_attention

    with pytest.raises(SystemExit, match="no-such-revision"):
        bench_attention.source_at("no-such-revision")
