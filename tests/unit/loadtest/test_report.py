"""The load-test report: table numbers, SLO verdicts and plot files a reader of report.md sees."""

from __future__ import annotations

from pathlib import Path

from loadtest.report import load_runs, max_rate_under_slo, save_runs, write_report
from loadtest.results import SLO, RequestResult, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OUTPUT_TOKENS = 11
CHUNK_GAP_S = 0.1  # so ITL = TPOT = 100 ms and E2E = TTFT + 1 s


def _ok(i: int, ttft_s: float) -> RequestResult:
    chunks = [ttft_s + CHUNK_GAP_S * j for j in range(OUTPUT_TOKENS)]
    return RequestResult(f"ok-{i}", sent_s=0.0, status=200, prompt_tokens=5,
                         output_tokens=OUTPUT_TOKENS, first_token_s=ttft_s, chunk_times_s=chunks,
                         finish_s=chunks[-1])


def _run(label: str, rate: float | None, ttfts_s: list[float], series: str = "continuous",
         timeline: list[dict] | None = None) -> dict:
    """ok requests with the given TTFTs, plus one refused (429) and one timed-out request."""
    results = [_ok(i, t) for i, t in enumerate(ttfts_s)]
    results += [RequestResult("shed", sent_s=0.0, status=429),
                RequestResult("lost", sent_s=0.0, status=0, error="timeout")]
    return {"label": label, "series": series, "rate": rate, "concurrency": None,
            "summary": summarize(results, SLO(ttft_s=0.5), duration_s=2.0),
            "results": [r.to_dict() for r in results], "timeline": timeline or []}


def _timeline() -> list[dict]:
    return [{"t_s": t, "num_waiting": 3 * t, "num_running": 8, "kv_usage": 0.5,
             "replicas": 1 + t // 2} for t in range(5)]


def _sweep() -> list[dict]:
    return [_run("cont @ 1", 1.0, [0.05, 0.1]), _run("cont @ 2", 2.0, [0.1, 0.3]),
            _run("cont @ 4", 4.0, [0.5, 2.0], timeline=_timeline()),
            _run("static @ 1", 1.0, [0.6, 0.9], series="static"),
            _run("static @ 2", 2.0, [1.0, 3.0], series="static")]


def _row(report: Path, label: str) -> str:
    rows = [line for line in report.read_text().splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, rows
    return rows[0]


def test_table_row_shows_counts_throughput_latencies_in_ms_and_goodput(tmp_path):
    report = write_report(tmp_path, "Bench", [_run("cont @ 2", 2.0, [0.1, 0.2, 1.0])])
    # 3 ok of 5 over 2 s: 1.50 req/s and 33 tok / 2 s; TTFT p50 0.2 s, p99 0.2 + 0.8 * 0.98 s;
    # E2E = TTFT + 1 s; goodput: 2 of all 5 requests have TTFT <= 0.5 s.
    assert _row(report, "cont @ 2") == ("| cont @ 2 | 2 | 3/1/1 | 1.50 | 16.5 | 200 / 984 | "
                                        "100 / 100 | 100 | 1200 / 1984 | 40.0% |")
    text = report.read_text()
    assert text.startswith("# Bench\n")
    assert "TTFT p50/p99 (ms)" in text and "Output (tok/s)" in text


def test_notes_become_bullets_and_pipes_in_labels_do_not_break_the_table(tmp_path):
    report = write_report(tmp_path, "Bench", [_run("a|b", 2.0, [0.1])],
                          notes=["H200, 1 replica", "prompt 512 tokens"])
    text = report.read_text()
    assert "- H200, 1 replica\n- prompt 512 tokens\n" in text
    assert _row(report, "a\\|b").count(" | ") == 9  # ten cells


def test_writes_valid_pngs_and_links_each_from_the_report(tmp_path):
    out_dir = tmp_path / "nested" / "out"
    report = write_report(out_dir, "Sweep", _sweep(), slo_ttft_s=0.5)
    assert report == out_dir / "report.md"
    text = report.read_text()
    for name in ("latency_cdf.png", "sweep.png", "timeline_2.png"):
        assert (out_dir / name).read_bytes().startswith(PNG_MAGIC), name
        assert f"]({name})" in text
    # Only the run that sampled /metrics gets a timeline.
    assert sorted(p.name for p in out_dir.glob("timeline_*.png")) == ["timeline_2.png"]


def test_slo_verdict_per_series(tmp_path):
    text = write_report(tmp_path, "Sweep", _sweep(), slo_ttft_s=0.5).read_text()
    # continuous p99s: ~0.1, ~0.3, ~2.0 s; static never meets 0.5 s.
    assert "- continuous: highest offered rate with p99 TTFT <= SLO: 2 req/s" in text
    assert "- static: highest offered rate with p99 TTFT <= SLO: none" in text


def test_no_slo_section_without_slo_or_without_swept_runs(tmp_path):
    assert "highest offered rate" not in write_report(tmp_path / "a", "t", _sweep()).read_text()
    closed = _run("closed", None, [0.1]) | {"concurrency": 8}
    report = write_report(tmp_path / "b", "t", [closed], slo_ttft_s=0.5)
    assert "highest offered rate" not in report.read_text()
    assert _row(report, "closed").startswith("| closed | closed, c=8 |")
    assert not (tmp_path / "b" / "sweep.png").exists()  # nothing swept, so no sweep plot
    assert (tmp_path / "b" / "latency_cdf.png").exists()


def test_max_rate_under_slo_takes_the_highest_passing_rate_of_the_series():
    runs = _sweep()
    assert max_rate_under_slo(runs, "continuous", 0.5) == 2.0
    assert max_rate_under_slo(runs, "continuous", 10.0) == 4.0
    assert max_rate_under_slo(runs, "static", 10.0) == 2.0  # other series' 4 req/s not counted
    assert max_rate_under_slo(runs, "static", 0.5) is None
    assert max_rate_under_slo(runs, "unknown", 10.0) is None


def test_max_rate_under_slo_boundary_and_missing_p99():
    exactly = _run("edge", 1.0, [0.25, 0.25])
    assert max_rate_under_slo([exactly], "continuous", 0.25) == 1.0  # p99 == SLO passes
    # A run where nothing succeeded has no p99; it must not count as meeting the SLO.
    no_ok = _run("dead", 8.0, [])
    assert no_ok["summary"]["ttft_s"]["p99"] is None
    assert max_rate_under_slo([exactly, no_ok], "continuous", 0.5) == 1.0
    assert max_rate_under_slo([_run("closed", None, [0.1])], "continuous", 0.5) is None


def test_run_without_ok_results_or_timeline_renders_dashes(tmp_path):
    report = write_report(tmp_path, "Outage", [_run("dead", None, [])], slo_ttft_s=0.5)
    assert _row(report, "dead") == ("| dead | - | 0/1/1 | 0.00 | 0.0 | - / - | - / - | - | "
                                    "- / - | 0.0% |")
    assert list(tmp_path.glob("*.png")) == []
    assert "![" not in report.read_text()


def test_summary_values_of_none_render_as_dashes(tmp_path):
    run = _run("partial", 1.0, [0.1])
    run["summary"].update(request_throughput=None, goodput=None, num_shed=None, itl_s=None)
    del run["summary"]["output_throughput"]
    row = _row(write_report(tmp_path, "t", [run]), "partial")
    assert row.startswith("| partial | 1 | 1/-/1 | - | - | 100 / 100 | - / - | 100 |")
    assert row.endswith("| - |")


def test_runs_round_trip_through_json_and_regenerate_the_same_report(tmp_path):
    runs = _sweep()
    save_runs(tmp_path / "runs.json", runs)
    loaded = load_runs(tmp_path / "runs.json")
    assert loaded == runs
    first = write_report(tmp_path / "a", "Sweep", runs, slo_ttft_s=0.5).read_text()
    assert write_report(tmp_path / "b", "Sweep", loaded, slo_ttft_s=0.5).read_text() == first
