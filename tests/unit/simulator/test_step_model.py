"""The simulator's step-time model: features of real SchedulerOutputs, the fit, the shipped profiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contracts.sampling import SamplingParams
from simulator.step_model import COEFFICIENTS, StepFeatures, StepTimeModel, features, fit, nnls
from model_worker.sched.batch import ScheduledSequence, SchedulerOutput

PROFILES = Path(__file__).resolve().parents[3] / "simulator" / "profiles"
SHIPPED = ("tiny-cpu", "smollm2-cpu", "llama3-8b-h100")
TRUE = dict(base_s=4e-3, prefill_token_s=2e-5, decode_seq_s=5e-5, context_token_s=3e-8, prefill_attention_s=2e-9)


def seq(num_tokens: int, start: int, block_size: int = 16) -> ScheduledSequence:
    return ScheduledSequence(request_id=f"r{start}-{num_tokens}", token_ids=[7] * num_tokens, start_position=start,
                             block_table=list(range(-(-(start + num_tokens) // block_size))), sample=True,
                             sampling_params=SamplingParams(temperature=0.0))


def step(*shape: tuple[int, int]) -> SchedulerOutput:
    sequences = [seq(n, start) for n, start in shape]
    return SchedulerOutput(sequences=sequences, num_scheduled_tokens=sum(n for n, _ in shape))


def decode_step(batch: int, context: int) -> SchedulerOutput:
    return step(*[(1, context)] * batch)


# --- features ---

def test_features_of_a_decode_only_step():
    f = features(step((1, 10), (1, 30), (1, 0)))
    assert f == StepFeatures(prefill_tokens=0, decode_seqs=3, context_tokens=40, prefill_attention=0.0, num_seqs=3)


def test_features_of_a_chunk_from_zero_and_over_a_cached_context():
    assert features(step((64, 0))) == StepFeatures(64, 0, 0, 64 * 32, 1)
    # 32 new tokens over 100 cached: each attends to the 100 and to half the chunk on average.
    assert features(step((32, 100))) == StepFeatures(32, 0, 100, 32 * (100 + 16), 1)


def test_features_of_a_mixed_step():
    f = features(step((1, 50), (1, 70), (128, 256), (16, 0)))
    assert (f.prefill_tokens, f.decode_seqs, f.context_tokens, f.num_seqs) == (144, 2, 376, 4)
    assert f.prefill_attention == 128 * (256 + 64) + 16 * 8


def test_empty_step_costs_nothing():
    model = StepTimeModel(**TRUE)
    assert model.predict(SchedulerOutput()) == 0.0
    assert model.predict_features(features(SchedulerOutput())) == 0.0


# --- fit ---

def synthetic_samples(noise: float, seed: int = 0) -> list[tuple[StepFeatures, float]]:
    rng = np.random.default_rng(seed)
    truth = StepTimeModel(**TRUE)
    shapes = [[(1, c)] * b for b in (1, 4, 16, 64, 128) for c in (16, 256, 1024)]
    shapes += [[(n, p)] for n in (32, 128, 512) for p in (0, 512, 2048, 4096)]
    shapes += [[(1, 256)] * d + [(n, 0)] for d in (4, 32) for n in (64, 256)]
    samples = []
    for shape in shapes:
        f = features(step(*shape))
        samples.append((f, truth.predict_features(f) * (1 + noise * rng.standard_normal())))
    return samples


def test_fit_recovers_known_coefficients_and_reports_its_error():
    model = fit(synthetic_samples(noise=0.01), model="synthetic", device="cpu", dtype="float32", source="test")
    for name, value in TRUE.items():
        assert getattr(model, name) == pytest.approx(value, rel=0.1), name
    assert model.fit["num_points"] == len(model.points) == 31
    assert 0 < model.fit["median_rel_error"] < 0.02
    assert model.fit["median_rel_error"] <= model.fit["p90_rel_error"] <= model.fit["max_rel_error"] < 0.05
    assert (model.model, model.device, model.source) == ("synthetic", "cpu", "test")


def test_fit_is_exact_without_noise_and_never_negative():
    model = fit(synthetic_samples(noise=0.0))
    assert model.fit["max_rel_error"] < 1e-6
    # Times that fall with context would need a negative coefficient: it is clamped to 0 instead.
    samples = [(features(decode_step(8, c)), 0.05 - 1e-6 * c) for c in (16, 128, 512, 1024, 2048)]
    samples += [(features(step((n, 0))), 0.05 + 1e-4 * n) for n in (32, 128, 512)]
    clamped = fit(samples)
    assert all(getattr(clamped, name) >= 0 for name in COEFFICIENTS)
    assert clamped.context_token_s == 0.0


def test_nnls_matches_the_unconstrained_solution_when_it_is_feasible():
    rng = np.random.default_rng(1)
    a = rng.uniform(0, 1, (20, 4))
    x = np.array([0.5, 0.0, 2.0, 1e-3])
    solved = nnls(a, a @ x)
    np.testing.assert_allclose(solved, x, atol=1e-9)
    solved = nnls(a, a @ np.array([1.0, -1.0, 1.0, 0.0]))
    assert (solved >= 0).all() and solved[1] == 0.0


def test_fit_refuses_too_few_or_bad_samples():
    samples = synthetic_samples(noise=0.0)
    with pytest.raises(ValueError, match="at least"):
        fit(samples[:3])
    with pytest.raises(ValueError, match="> 0"):
        fit([(f, 0.0) for f, _ in samples])
    with pytest.raises(ValueError, match="base_s"):
        StepTimeModel(**{**TRUE, "base_s": -1.0})


def test_predict_matches_predict_features():
    model = StepTimeModel(**TRUE)
    for batch in (decode_step(64, 1024), step((512, 0)), step((1, 50), (128, 256), (16, 0)), step((1, 0))):
        assert model.predict(batch) == pytest.approx(model.predict_features(features(batch)), rel=1e-12)


def test_save_and_load_round_trip(tmp_path):
    model = fit(synthetic_samples(noise=0.01), model="m", device="cpu", dtype="float32", source="s", measured=True,
                created="2026-12-01", details={"repeats": 5})
    path = tmp_path / "profile.json"
    model.save(path)
    loaded = StepTimeModel.load(path)
    assert loaded == model
    assert json.loads(path.read_text())["points"][0]["seconds"] == model.points[0][1]
    with pytest.raises(ValueError, match="format"):
        StepTimeModel.from_dict({**model.to_dict(), "format": 99})


def test_importing_the_module_imports_no_torch():
    code = "import sys, simulator.step_model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- the shipped profiles ---

@pytest.fixture(params=SHIPPED)
def shipped(request) -> StepTimeModel:
    return StepTimeModel.load(PROFILES / f"{request.param}.json")


def test_shipped_profiles_have_positive_costs_and_a_source(shipped):
    assert shipped.base_s > 0 and shipped.prefill_token_s > 0 and shipped.decode_seq_s > 0
    assert shipped.model and shipped.device and shipped.dtype and shipped.created
    assert len(shipped.source) > 40


def test_shipped_profiles_predict_monotone_times(shipped):
    for context in (16, 512, 2048):
        times = [shipped.predict(decode_step(batch, context)) for batch in (1, 2, 8, 32, 64, 128, 256)]
        assert times == sorted(times)
    for start in (0, 1024):
        times = [shipped.predict(step((n, start))) for n in (2, 32, 128, 512, 2048)]
        assert times == sorted(times)
    mixed = [shipped.predict(step(*[(1, 256)] * 16, (n, 0))) for n in (2, 64, 256, 512)]
    assert mixed == sorted(mixed)
    assert shipped.predict(decode_step(8, 2048)) >= shipped.predict(decode_step(8, 16))


@pytest.mark.parametrize("name", ["tiny-cpu", "smollm2-cpu"])
def test_measured_profiles_keep_their_points_and_fit(name):
    profile = StepTimeModel.load(PROFILES / f"{name}.json")
    assert profile.measured and profile.source.startswith("measured on")
    assert profile.fit["num_points"] == len(profile.points) >= 40
    assert profile.fit_error(profile.points).items() <= profile.fit.items()
    assert profile.fit["median_rel_error"] < 0.25


def test_h100_profile_is_first_principles_and_sane():
    profile = StepTimeModel.load(PROFILES / "llama3-8b-h100.json")
    assert not profile.measured and not profile.points
    assert "not measured" in profile.source and "3.35 TB/s" in profile.source and "989 TFLOP/s" in profile.source
    assert 5e-3 <= profile.predict(decode_step(64, 1024)) <= 15e-3
    assert 5e-3 <= profile.predict(decode_step(1, 16)) <= 8e-3
    assert profile.details["kv_bytes_per_token"] == 131072


def test_fit_finds_the_extra_cost_of_a_step_of_more_than_one_row():
    """The CPU's one-row matmul path: a one-token step costs less than the line through the others."""
    from simulator.step_model import StepFeatures, fit

    def step_s(decodes: int) -> float:
        return 0.1 + 0.004 * decodes + (0.07 if decodes >= 2 else 0.0)

    samples = [(StepFeatures(0, n, 100 * n, 0.0, n), step_s(n)) for n in (1, 2, 3, 4, 8, 16, 32, 64)]
    samples += [(StepFeatures(t, 0, 0, t * t / 2, 1), 0.1 + 0.002 * t + 0.07 + 1e-7 * t * t / 2) for t in (16, 64, 256)]
    model = fit(samples)
    assert model.multi_row_s == pytest.approx(0.07, rel=0.05)
    assert model.fit["max_rel_error"] < 0.01


def test_fit_finds_what_the_first_step_after_an_idle_spell_costs():
    """An engine that slept wakes its threads and finds its caches cold: the same step costs more
    after idling than in a busy run. Without the feature the fit spreads it over prompt tokens."""
    from simulator.step_model import StepFeatures, fit

    def step_s(tokens: int, after_idle: bool) -> float:
        return 0.001 + 1e-5 * tokens + (0.0015 if after_idle else 0.0)

    samples = [(StepFeatures(t, 0, 0, t * t / 2, 1, after_idle), step_s(t, after_idle))
               for t in (16, 32, 64, 128, 256) for after_idle in (False, True)]
    samples += [(StepFeatures(0, n, 100 * n, 0.0, n), 0.001 + 2e-6 * n) for n in (1, 4, 16)]
    model = fit(samples)
    assert model.idle_wake_s == pytest.approx(0.0015, rel=0.05)
    assert model.fit["max_rel_error"] < 0.05
    assert model.predict_features(StepFeatures(20, 0, 0, 200.0, 1, True)) > model.predict_features(StepFeatures(20, 0, 0, 200.0, 1))


def test_a_profile_keeps_its_idle_wake_and_an_older_one_reads_as_none(tmp_path):
    from simulator.step_model import StepFeatures, StepTimeModel

    model = StepTimeModel(0.001, 1e-5, 2e-6, 0.0, 0.0, idle_wake_s=0.002,
                          points=[(StepFeatures(16, 0, 0, 128.0, 1, True), 0.0032)])
    model.save(tmp_path / "p.json")
    again = StepTimeModel.load(tmp_path / "p.json")
    assert again.idle_wake_s == 0.002 and again.points[0][0].after_idle
    data = model.to_dict()
    del data["coefficients"]["idle_wake_s"]
    del data["points"][0]["after_idle"]
    older = StepTimeModel.from_dict(data)
    assert older.idle_wake_s == 0.0 and not older.points[0][0].after_idle
