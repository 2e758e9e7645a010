"""loadtest.benchmarks.gpu_check, the prepared GPU device check: its --smoke run on the CPU goes through every
section with tiny shapes, so the device run can only differ in sizes and device."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtest.benchmarks import hf_baselines
from loadtest.benchmarks.gpu_check import agreement, evaluate_targets

ROOT = Path(__file__).resolve().parents[3]
REQUIRED_KEYS = (
    "device_name", "torch_version", "triton_version", "transformers_version", "smoke", "copy_gb_s", "matmul_tflops",
    "decode", "decode_b64_frac_of_floor", "prefill_tok_s", "prefill_frac_of_matmul", "smollm2_greedy_equal_frac",
    "random8b_top1_agree", "tok_s_ours", "tok_s_hf_generate", "tok_s_hf_continuous", "ours_over_generate",
    "ours_over_hf_continuous", "targets", "errors", "wall_s",
)
NUMBER_KEYS = ("copy_gb_s", "matmul_tflops", "decode_b64_frac_of_floor", "prefill_tok_s", "prefill_frac_of_matmul",
               "smollm2_greedy_equal_frac", "random8b_top1_agree", "random8b_logits_rel_diff", "tok_s_ours",
               "tok_s_hf_generate", "tok_s_hf_continuous", "ours_over_generate", "ours_over_hf_continuous", "wall_s")


@pytest.fixture(scope="module")
def smoke_report() -> dict:
    proc = subprocess.run([sys.executable, "-m", "loadtest.benchmarks.gpu_check", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_smoke_runs_every_section_without_error(smoke_report):
    assert smoke_report["smoke"] is True
    assert smoke_report["errors"] == {}
    assert "skipped" not in smoke_report["smollm2"]
    missing = [key for key in REQUIRED_KEYS if key not in smoke_report]
    assert not missing, missing
    for key in NUMBER_KEYS:
        assert isinstance(smoke_report[key], (int, float)) and math.isfinite(smoke_report[key]), key
    assert all(math.isfinite(n) for n in numbers(smoke_report))
    assert smoke_report["wall_s"] < 60


def test_smoke_float32_engine_matches_transformers(smoke_report):
    # float32 on the CPU: our decoder and transformers agree to rounding, token for token.
    assert smoke_report["smollm2_greedy_equal_frac"] == 1.0
    assert smoke_report["random8b_top1_agree"] == 1.0
    assert smoke_report["random8b_logits_rel_diff"] < 1e-4


def test_smoke_decode_has_a_floor_for_every_batch(smoke_report):
    rows = smoke_report["decode"]
    assert [row["batch"] for row in rows] == [1, 16, 64]
    for row in rows:
        assert row["step_ms"] > 0 and 0 < row["floor_ms"] and row["frac_of_floor"] == pytest.approx(
            row["floor_ms"] / row["step_ms"])
    # More sequences read more K/V: the floor grows with the batch.
    assert rows[0]["bytes_read"] < rows[1]["bytes_read"] < rows[2]["bytes_read"]
    assert smoke_report["decode_b64_frac_of_floor"] == rows[2]["frac_of_floor"]


def test_smoke_targets_carry_values_and_verdicts(smoke_report):
    targets = smoke_report["targets"]
    assert set(targets) == {"decode_b64_frac_of_floor", "ours_over_generate", "ours_over_hf_continuous",
                            "smollm2_greedy_equal_frac"}
    for key, target in targets.items():
        assert target["value"] == smoke_report[key]
        assert target["pass"] == (target["value"] >= target["min"])


def test_a_target_not_measured_is_neither_pass_nor_fail():
    targets = evaluate_targets({"ours_over_generate": 3.2, "ours_over_hf_continuous": 1.2})
    assert targets["ours_over_generate"]["pass"] is True
    assert targets["ours_over_hf_continuous"]["pass"] is False
    assert targets["decode_b64_frac_of_floor"] == {"min": 0.6, "value": None, "pass": None}


def test_agreement_counts_identical_outputs_and_common_prefixes():
    equal, prefix = agreement([[1, 2, 3], [1, 2, 9], [7, 8, 9]], [[1, 2, 3], [1, 2, 3], [1, 8, 9]])
    assert equal == pytest.approx(1 / 3)
    assert prefix == pytest.approx((3 + 2 + 0) / 3)


def test_the_check_imports_no_ray():
    # The device machine has no Ray: the check and what it imports must not need it.
    code = ("import sys, loadtest.benchmarks.gpu_check; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'deployments')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_hf_continuous_config_fits_transformers_5_17(monkeypatch):
    # The device machine's transformers 5.17 calls the page size block_size and has no
    # auto_switch_to_flash; newer ones call it page_size.
    @dataclass
    class Config517:
        block_size: int = 256
        num_blocks: int | None = None
        max_batch_tokens: int | None = None
        max_requests_per_batch: int | None = None
        allow_block_sharing: bool = True
        use_cuda_graph: bool | None = None
        use_async_batching: bool | None = None
        seed: int | None = None

    monkeypatch.setattr(hf_baselines, "ContinuousBatchingConfig", Config517)
    config = hf_baselines._cb_config(hf_baselines.HFContinuousOptions(page_size=32, use_cuda_graph=None))
    assert config.block_size == 32 and config.num_blocks == 2048
    assert config.use_cuda_graph is None and config.use_async_batching is False
