"""Benchmark metrics: percentiles, per-request latencies and useful-token throughput."""

import numpy as np
import pytest

from loadtest.metrics import RequestRecord, format_table, percentile, summarize, useful_tokens_per_s


def test_percentile_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(7)
    for size in (1, 2, 5, 101, 1000):
        values = rng.exponential(2.0, size=size).tolist()
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_known_values():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order of input does not matter


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _timeline() -> list[RequestRecord]:
    # Ten requests arriving every second; request i waits (i+1)*0.1 s for its first token and
    # runs 2 s in all; each produces 10 tokens. The last finishes at 9 + 2 = 11 s.
    return [RequestRecord(f"r{i}", arrival_s=float(i), output_tokens=10,
                          first_token_s=i + (i + 1) * 0.1, finish_s=i + 2.0) for i in range(10)]


def test_summary_of_synthetic_timeline():
    s = summarize(_timeline())
    assert s.num_requests == 10
    assert s.useful_tokens == 100
    assert s.wall_s == pytest.approx(11.0)
    assert s.useful_tokens_per_s == pytest.approx(100 / 11.0)
    ttfts = [(i + 1) * 0.1 for i in range(10)]
    assert s.ttft_p50_s == pytest.approx(np.percentile(ttfts, 50))
    assert s.ttft_p99_s == pytest.approx(np.percentile(ttfts, 99))
    assert s.ttft_p50_s < s.ttft_p90_s < s.ttft_p99_s <= 1.0
    assert s.e2e_p50_s == pytest.approx(2.0) and s.e2e_p99_s == pytest.approx(2.0)


def test_only_each_requests_own_tokens_count():
    # A static batch: both finish together at 4 s, padded to the longer output, but the short
    # request is credited its own 8 tokens only.
    records = [RequestRecord("long", 0.0, 32, first_token_s=1.0, finish_s=4.0),
               RequestRecord("short", 0.0, 8, first_token_s=1.0, finish_s=4.0)]
    assert useful_tokens_per_s(records, 4.0) == pytest.approx(10.0)
    assert summarize(records).useful_tokens_per_s == pytest.approx(10.0)


def test_summary_refuses_unfinished_requests():
    records = _timeline()
    records[3].finish_s = None
    with pytest.raises(ValueError, match="unfinished"):
        summarize(records)


def test_record_latencies_are_relative_to_arrival():
    rec = RequestRecord("r", arrival_s=5.0, output_tokens=3, first_token_s=5.25, finish_s=6.5)
    assert rec.ttft_s == pytest.approx(0.25)
    assert rec.e2e_s == pytest.approx(1.5)
    with pytest.raises(ValueError):
        _ = RequestRecord("x", 0.0, 1).ttft_s


def test_table_has_one_row_per_system():
    table = format_table({"ours": summarize(_timeline()), "theirs": summarize(_timeline())})
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("ours") and lines[3].startswith("theirs")
    assert "9.1" in lines[2]  # 100 tokens / 11 s
