"""Run summaries on synthetic timelines whose percentiles are known: HTTP load tests and offline
engine runs, and the percentile both use."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.results import SLO, RequestResult, distribution, format_table, summarize, summarize_offline
from model_worker.engine.stats import percentile


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


def test_percentile_of_nothing_is_none_and_rejects_out_of_range():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def timeline() -> list[RequestResult]:
    """Ten requests sent every second. Request i: TTFT (i+1)*0.1 s, then 9 more chunks 0.05 s
    apart (10 tokens), so E2E = TTFT + 0.45 s and TPOT = 0.05 s."""
    results = []
    for i in range(10):
        sent = float(i)
        first = sent + (i + 1) * 0.1
        chunks = [first + 0.05 * k for k in range(10)]
        results.append(RequestResult(f"r{i}", arrival_s=sent, sent_s=sent, status=200, prompt_tokens=20,
                                     output_tokens=10, first_token_s=first, chunk_times_s=chunks, finish_s=chunks[-1]))
    return results


def test_latency_distributions_match_numpy():
    s = summarize(timeline())
    ttfts = [(i + 1) * 0.1 for i in range(10)]
    for q in (50, 90, 99):
        assert s["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q))
        assert s["e2e_s"][f"p{q}"] == pytest.approx(np.percentile([t + 0.45 for t in ttfts], q))
    assert s["ttft_s"]["mean"] == pytest.approx(0.55)
    assert s["itl_s"]["p50"] == pytest.approx(0.05) and s["itl_s"]["p99"] == pytest.approx(0.05)
    assert s["tpot_s"]["p50"] == pytest.approx(0.05)


def test_throughput_counts_only_successful_requests_over_the_run():
    s = summarize(timeline())
    # From the first send (0 s) to the last finish (9 + 1.0 + 0.45 s).
    assert s["duration_s"] == pytest.approx(10.45)
    assert s["request_throughput"] == pytest.approx(10 / 10.45)
    assert s["output_throughput"] == pytest.approx(100 / 10.45)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (200, 100)


def test_refused_failed_and_unsent_requests_are_counted_not_dropped():
    results = timeline()
    results += [RequestResult("shed", sent_s=1.0, status=429, error="overloaded"),
                RequestResult("broken", sent_s=2.0, status=200, error="engine stopped", first_token_s=2.1,
                              chunk_times_s=[2.1]),
                RequestResult("never", error="not sent: the run's time limit came first")]
    s = summarize(results)
    assert (s["num_requests"], s["num_ok"], s["num_shed"], s["num_errors"]) == (13, 10, 1, 2)
    assert s["statuses"] == {"200": 11, "429": 1, "0": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)  # latency only from successful requests


def test_goodput_is_the_share_of_all_requests_meeting_the_slo():
    results = timeline() + [RequestResult("shed", sent_s=1.0, status=429, error="overloaded")]
    # TTFT <= 0.5 s holds for r0..r4; every TPOT is 0.05.
    s = summarize(results, SLO(ttft_s=0.5, tpot_s=0.06))
    assert s["goodput"] == pytest.approx(5 / 11)
    assert s["goodput_rps"] == pytest.approx(5 / s["duration_s"])
    assert summarize(results, SLO(ttft_s=0.5, tpot_s=0.04))["goodput"] == 0.0
    assert summarize(results)["goodput"] == pytest.approx(10 / 11)


def test_empty_distributions_are_none_and_round_trip():
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    result = timeline()[3]
    assert RequestResult.from_dict(result.to_dict()) == result
    with pytest.raises(ValueError):
        summarize([])


def offline_timeline() -> list[RequestResult]:
    """Ten offline requests arriving every second; request i waits (i+1)*0.1 s for its first token
    and runs 2 s in all; each produces 10 tokens. The last finishes at 9 + 2 = 11 s."""
    return [RequestResult.offline(f"r{i}", arrival_s=float(i), output_tokens=10,
                                  first_token_s=i + (i + 1) * 0.1, finish_s=i + 2.0) for i in range(10)]


def test_offline_summary_of_synthetic_timeline():
    s = summarize_offline(offline_timeline())
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
    records = [RequestResult.offline("long", 0.0, 32, first_token_s=1.0, finish_s=4.0),
               RequestResult.offline("short", 0.0, 8, first_token_s=1.0, finish_s=4.0)]
    assert summarize(records, duration_s=4.0)["output_throughput"] == pytest.approx(10.0)
    assert summarize_offline(records).useful_tokens_per_s == pytest.approx(10.0)


def test_offline_summary_refuses_unfinished_requests_and_no_wall_time():
    records = offline_timeline()
    records[3].finish_s = None
    with pytest.raises(ValueError, match="unfinished"):
        summarize_offline(records)
    with pytest.raises(ValueError, match="wall_s"):
        summarize_offline(offline_timeline(), start_s=11.0)


def test_offline_latencies_are_relative_to_arrival():
    rec = RequestResult.offline("r", arrival_s=5.0, output_tokens=3, first_token_s=5.25, finish_s=6.5)
    assert rec.ttft_s == pytest.approx(0.25)
    assert rec.e2e_s == pytest.approx(1.5)
    assert RequestResult.offline("x", 0.0, 1).ttft_s is None
    with pytest.raises(ValueError, match="unfinished"):
        summarize_offline([RequestResult.offline("x", 0.0, 1)])


def test_table_has_one_row_per_system():
    table = format_table({"ours": summarize_offline(offline_timeline()),
                          "theirs": summarize_offline(offline_timeline())})
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("ours") and lines[3].startswith("theirs")
    assert "9.1" in lines[2]  # 100 tokens / 11 s
