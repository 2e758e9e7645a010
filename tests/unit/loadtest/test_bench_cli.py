"""`iterserve bench` argument parsing and workload building (no server, no model)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from loadtest import bench_cli
from loadtest.results import RequestResult, summarize

POOL = np.arange(10, 500)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_lengths_and_rates_parse_with_clear_errors():
    assert bench_cli.parse_length("fixed:40") == bench_cli.wl.LengthDist("fixed", 40, 40, 40)
    assert bench_cli.parse_length("uniform:64:8:128") == bench_cli.wl.LengthDist("uniform", 64, 8, 128)
    assert bench_cli.parse_length("lognormal:100:4:400:0.8").sigma == 0.8
    with pytest.raises(ValueError, match="KIND:MEAN"):
        bench_cli.parse_length("fixed")
    assert bench_cli.parse_rates("1, 2.5,inf") == [1.0, 2.5, None]
    with pytest.raises(ValueError, match="> 0"):
        bench_cli.parse_rates("0")


@pytest.mark.parametrize("argv,count", [
    (["--workload", "synthetic", "--num-requests", "12", "--prompt-len", "fixed:30"], 12),
    (["--workload", "shared-prefix", "--num-requests", "10", "--prefixes", "3"], 12),  # rounded up to 3 x 4
    (["--workload", "multi-turn", "--num-requests", "3", "--turns", "4"], 12),
])
def test_each_workload_kind_builds(argv, count):
    args = parse(*argv, "--batch-fraction", "0.5")
    workload = bench_cli.build_workload(args, POOL, 4.0)
    assert len(workload) == count
    assert sum(r.priority == "batch" for r in workload) == count // 2
    assert workload == bench_cli.build_workload(args, POOL, 4.0)  # seeded


def test_trace_workload_is_retimed_to_the_asked_rate():
    """The trace ships with the package: this runs on any checkout."""
    args = parse("--workload", "trace", "--num-requests", "200")
    workload = bench_cli.build_workload(args, POOL, 5.0)
    assert (len(workload) - 1) / workload[-1].arrival_s == pytest.approx(5.0)
    assert all(r.arrival_s == 0.0 for r in bench_cli.build_workload(args, POOL, None))


def test_outputs_and_summary_line(tmp_path):
    results = [RequestResult("a", sent_s=0.0, status=200, output_tokens=4, prompt_tokens=9, first_token_s=0.2,
                             chunk_times_s=[0.2, 0.3, 0.4, 0.5], finish_s=0.5),
               RequestResult("b", sent_s=0.1, status=429, error="overloaded")]
    run = {"label": "x @ 2 req/s", "series": "x", "rate": 2.0, "concurrency": None,
           "summary": summarize(results), "results": [r.to_dict() for r in results], "timeline": []}
    line = bench_cli.summary_line(run)
    assert "ok 1/2 shed 1 errors 0" in line and "TTFT p50 200 p99 200 ms" in line and "TPOT p50 100 ms" in line
    bench_cli.write_outputs(tmp_path, [run])
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["request_id"] for r in rows] == ["a", "b"] and rows[1]["status"] == 429
    assert json.loads((tmp_path / "summary.json").read_text())[0]["num_shed"] == 1


def test_autoscaling_recovery_and_cold_start_arithmetic():
    from loadtest.benchmarks.bench_autoscaling import cold_starts_s, recovery_s, violation_s

    # 2 s bins; step up at 10, down at 40; the SLO (1 s) breaks at 12-16, holds at 18-22, a blip
    # at 26: recovery is 18 - 10 = 8 s (three good bins in a row), 8 s of bins over the SLO.
    bins = [(t, 0.2) for t in range(0, 12, 2)] + [(12, 3.0), (14, 2.0), (16, 1.5), (18, 0.5), (20, 0.4),
                                                   (22, 0.3), (24, 0.4), (26, 1.2), (28, 0.3)]
    assert recovery_s(bins, 10, 40, 1.0) == 8
    assert violation_s(bins, 10, 40, 1.0) == 8
    assert recovery_s([(t, 0.2) for t in range(0, 40, 2)], 10, 40, 1.0) == 0.0  # never broke
    assert recovery_s([(t, 5.0) for t in range(10, 40, 2)], 10, 40, 1.0) == 30  # never came back
    # Serve starts 2 replicas at t=1 and 1 at t=3; they run at t=5, 6 and 9: 4, 5, 6 s.
    samples = [(0, 1, 1), (1, 1, 3), (3, 1, 4), (5, 2, 4), (6, 3, 4), (9, 4, 4)]
    assert cold_starts_s(samples) == [4, 5, 6]
