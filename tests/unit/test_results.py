"""Load-test summaries on a synthetic timeline whose percentiles are known."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.results import SLO, RequestResult, distribution, summarize


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
