"""bench_engine_kernels end to end on the tiny model: both builds run, their outputs compared."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from model_worker.runner.cpu_kernels import ops

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(ops.kernels() is None, reason="the CPU kernels do not build here")]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--model", "tiny", "--rounds", "2", "--num-requests", "4", "--prompt-tokens", "24", "--output-tokens", "3",
         "--engine-args", '{"num_kv_blocks": 256}']
# RMSNorm's scale, made to depend on the row: a build whose outputs differ from this checkout's.
NORM_SCALE = "const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);"


def test_the_same_kernels_give_the_same_tokens_and_every_figure():
    from loadtest.benchmarks import bench_engine_kernels

    report = bench_engine_kernels.main(["--before", "HEAD", *SMALL])
    assert report["other"] == "before" and report["identical_requests"] == 4
    for name in ("this", "before"):
        assert set(report["runs"][name]) == {"wall_s", "tokens_per_s", "decode_step_ms", "batch1_step_ms"}
        assert all(len(values) == 2 and min(values) > 0 for values in report["runs"][name].values()), name
    assert all(ratio > 0 for ratio in report["other_over_this"].values())
    assert set(report["other_over_this_paired"]) == set(report["other_over_this"])
    assert all(ratio > 0 for ratio in report["other_over_this_paired"].values())


def test_a_variant_that_changes_the_numbers_is_counted(tmp_path):
    from loadtest.benchmarks import bench_engine_kernels

    source = subprocess.run(["git", "show", "HEAD:model_worker/runner/cpu_kernels/kernels.cpp"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    assert NORM_SCALE in source
    variant = tmp_path / "kernels.cpp"
    variant.write_text(source.replace(NORM_SCALE, NORM_SCALE[:-1] + " * (r % 2 ? 3.f : 0.25f);"))
    report = bench_engine_kernels.main(["--variant", str(variant), "--dtype", "float32", *SMALL[:-2]])
    assert report["other"] == "variant" and report["variant"] == str(variant)
    assert report["identical_requests"] < 4


def test_cycling_hands_out_every_block_and_empties_the_prefix_cache():
    import numpy as np

    from loadtest.bench_cli import token_pool
    from loadtest.benchmarks import bench_engine_kernels
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=300))
    bench_engine_kernels.cycle_pool(engine, token_pool("tiny"), np.random.default_rng(0))
    pool = bench_engine_kernels.kv_pool(engine)
    assert len(pool.blocks) == pool.num_blocks == 300 and pool.num_free_blocks == 300
    assert not engine.has_unfinished() and all(block.block_hash is None for block in pool.blocks)


def test_bad_arguments_are_refused_with_the_reason(capsys, tmp_path):
    from loadtest.benchmarks import bench_engine_kernels

    for argv, reason in (([], "one of the arguments"), (["--before", "HEAD", "--variant", "x.cpp"], "not allowed"),
                         (["--before", "HEAD", "--rounds", "0"], "--rounds"),
                         (["--before", "HEAD", "--output-tokens", "1"], "--output-tokens"),
                         (["--before", "HEAD", "--engine-args", "[1]"], "JSON object"),
                         (["--variant", str(tmp_path / "missing.cpp")], "no such file")):
        with pytest.raises(SystemExit):
            bench_engine_kernels.parse_args(argv)
        assert reason in capsys.readouterr().err


def test_a_variant_that_does_not_build_is_refused(tmp_path):
    from loadtest.benchmarks import bench_engine_kernels

    broken = tmp_path / "kernels.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(SystemExit, match="variant kernels.cpp"):
        bench_engine_kernels.main(["--variant", str(broken), *SMALL])
