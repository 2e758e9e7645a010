"""Benchmark workloads: trace loading, length scaling, arrivals and exact-length prompts."""

from pathlib import Path

import numpy as np
import pytest

from loadtest.traces import (
    LengthScaler,
    all_at_once,
    build_prompt,
    build_workload,
    default_trace_path,
    gamma_arrivals,
    load_azure_trace,
    normal_token_ids,
    poisson_arrivals,
    sample_lengths,
    scale_time,
)

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,4000,900
2023-11-16 18:15:51.3910170,12,1
"""


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    return path


def test_load_trace_times_are_seconds_from_first_row(trace_file):
    rows = load_azure_trace(trace_file)
    assert [r.context_tokens for r in rows] == [374, 396, 4000, 12]
    assert [r.generated_tokens for r in rows] == [44, 109, 900, 1]
    assert rows[0].arrival_s == 0.0
    assert rows[1].arrival_s == pytest.approx(4.314579)
    assert rows[3].arrival_s == pytest.approx(4.710427)


def test_load_trace_rejects_missing_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,3\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_azure_trace(path)


def test_scaler_divides_and_clamps():
    s = LengthScaler()  # prompt /4 in 8..512, output /2 in 4..256
    assert s.prompt_tokens(374) == 93
    assert s.prompt_tokens(12) == 8  # 3 -> floor of 8
    assert s.prompt_tokens(4000) == 512  # 1000 -> ceiling of 512
    assert s.output_tokens(109) == 54
    assert s.output_tokens(1) == 4
    assert s.output_tokens(900) == 256
    custom = LengthScaler(prompt_divisor=1, prompt_min_tokens=1, prompt_max_tokens=100, output_divisor=10,
                          output_min_tokens=2, output_max_tokens=3)
    assert (custom.prompt_tokens(50), custom.prompt_tokens(500)) == (50, 100)
    assert (custom.output_tokens(5), custom.output_tokens(25), custom.output_tokens(900)) == (2, 2, 3)


def test_scaler_rejects_inverted_clamps():
    with pytest.raises(ValueError):
        LengthScaler(prompt_min_tokens=600, prompt_max_tokens=512)
    with pytest.raises(ValueError):
        LengthScaler(output_divisor=0)


def test_sampling_is_seeded_and_within_clamps(trace_file):
    rows = load_azure_trace(trace_file)
    a = sample_lengths(rows, 50, LengthScaler(), seed=3)
    assert a == sample_lengths(rows, 50, LengthScaler(), seed=3)
    assert len(a) == 50
    assert all(8 <= p <= 512 and 4 <= o <= 256 for p, o in a)
    assert {p for p, _ in a} <= {93, 99, 512, 8}
    # Fewer requests than rows: drawn without replacement.
    assert sorted(sample_lengths(rows, 4, LengthScaler(), seed=1)) == sorted([(93, 22), (99, 54), (512, 256), (8, 4)])


def test_scale_time_speeds_up_and_starts_at_zero():
    assert scale_time([10.0, 12.0, 20.0], speedup=2.0) == [0.0, 1.0, 5.0]
    with pytest.raises(ValueError):
        scale_time([1.0], speedup=0)


def test_poisson_mean_rate_close_to_requested():
    arrivals = poisson_arrivals(20000, rate_per_s=8.0, seed=0)
    assert arrivals[0] == 0.0
    assert all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    observed_rate = (len(arrivals) - 1) / arrivals[-1]
    assert observed_rate == pytest.approx(8.0, rel=0.03)
    gaps = np.diff(arrivals)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: cv = 1


def test_gamma_arrivals_are_burstier_at_same_rate():
    bursty = gamma_arrivals(20000, rate_per_s=8.0, cv=3.0, seed=0)
    gaps = np.diff(bursty)
    assert (len(bursty) - 1) / bursty[-1] == pytest.approx(8.0, rel=0.1)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(3.0, rel=0.15)


def test_arrivals_are_reproducible_per_seed():
    assert poisson_arrivals(100, 4.0, seed=1) == poisson_arrivals(100, 4.0, seed=1)
    assert poisson_arrivals(100, 4.0, seed=1) != poisson_arrivals(100, 4.0, seed=2)
    assert all_at_once(3) == [0.0, 0.0, 0.0]


def test_prompts_have_exact_length_and_no_special_tokens():
    pool = normal_token_ids(100, special_ids=[0, 1, 2, 99])
    rng = np.random.default_rng(0)
    for n in (1, 8, 77, 512):
        prompt = build_prompt(n, pool, rng)
        assert len(prompt) == n
        assert not {0, 1, 2, 99} & set(prompt)
        assert all(0 <= t < 100 for t in prompt)


def test_workload_is_reproducible_and_sorted_by_arrival():
    pool = normal_token_ids(1000, special_ids=[0])
    lengths = [(10, 5), (20, 6), (30, 7)]
    arrivals = [2.0, 0.5, 1.0]
    a = build_workload(lengths, arrivals, pool, seed=4)
    assert a == build_workload(lengths, arrivals, pool, seed=4)
    assert [r.request_id for r in a] == ["req-1", "req-2", "req-0"]
    assert [(len(r.prompt_token_ids), r.output_tokens) for r in a] == [(20, 6), (30, 7), (10, 5)]
    assert build_workload(lengths, arrivals, pool, seed=5)[0].prompt_token_ids != a[0].prompt_token_ids


def test_the_trace_ships_with_the_package():
    """The trace ships inside the package (loadtest/data/, with its licence), so `iterserve bench
    --workload trace` needs no folder next to the repository."""
    path = default_trace_path()
    assert "loadtest" in path.parts and path.name == "azure_llm_2023_conv.csv"
    rows = load_azure_trace(path)
    assert len(rows) == 19366
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))
    assert "CC BY 4.0" in (path.parent / "README.md").read_text()


def test_a_missing_or_bad_trace_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the trace"):
        load_azure_trace(tmp_path / "nope.csv")
    (tmp_path / "bad.csv").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="bad.csv"):
        load_azure_trace(tmp_path / "bad.csv")
