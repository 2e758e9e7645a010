"""The simulator benchmark's figures draw what its JSON holds, series by series, and a part not run
draws nothing. Each figure's lines and bars are read back from the Figure before it is saved."""

from __future__ import annotations

import json

import pytest

from simulator.validation.plots import bench_figures, main, served_validation_figure, write_plots

POLICIES = ("prefix_aware", "pow2", "round_robin")


def routing_row(hit: float) -> dict:
    """Every policy its own figures at this size, so a series drawn from the wrong policy shows."""
    row = {policy: {"hit_rate": hit - 0.1 * k, "ttft_p50_s": 0.01 * (k + 1), "ttft_p99_s": 0.05 * (k + 1) + hit}
           for k, policy in enumerate(POLICIES)}
    row.update(report_bytes_per_replica_s_full=10_000.0 * hit, report_bytes_per_replica_s_delta=4_000.0 * hit)
    return row


def series(ax) -> dict[str, tuple[list[float], list[float]]]:
    """Label -> (x, y) of every labelled line of the axes."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines() if not line.get_label().startswith("_")}


ROUTING = {"16": routing_row(0.9), "64": routing_row(0.8), "256": routing_row(0.5)}
SPARES = {"step_at_s": 120.0, "replica_start_s": 60.0, "slo_s": 1.0,
          "spares_0": {"ready": [(0.0, 1), (200.0, 4)], "ttft_p90_bins": [(0.0, 0.02), (125.0, 3.0)]},
          "spares_1": {"ready": [(0.0, 2), (150.0, 3)], "ttft_p90_bins": [(0.0, 0.02), (130.0, 0.4)]}}


def test_the_routing_figure_draws_each_policys_hit_rate_and_ttft_by_replica_count():
    hit_ax, ttft_ax = bench_figures({"routing": ROUTING})["routing_scale.png"].axes
    counts = [16, 64, 256]
    hits, ttfts = series(hit_ax), series(ttft_ax)
    assert set(hits) == set(POLICIES)
    for policy in POLICIES:
        rows = [ROUTING[str(n)][policy] for n in counts]
        assert hits[policy] == (counts, [r["hit_rate"] for r in rows])
        assert ttfts[f"{policy} p50"] == (counts, pytest.approx([r["ttft_p50_s"] * 1e3 for r in rows]))
        assert ttfts[f"{policy} p99"] == (counts, pytest.approx([r["ttft_p99_s"] * 1e3 for r in rows]))


def test_a_policy_missing_at_a_size_is_drawn_where_it_was_run():
    routing = {"16": routing_row(0.9), "64": {k: v for k, v in routing_row(0.8).items() if k != "pow2"}}
    hit_ax, _ = bench_figures({"routing": routing})["routing_scale.png"].axes
    assert series(hit_ax)["pow2"] == ([16], [routing["16"]["pow2"]["hit_rate"]])
    assert series(hit_ax)["prefix_aware"][0] == [16, 64]


def test_the_report_traffic_figure_has_a_bar_per_size_for_snapshots_and_deltas():
    (ax,) = bench_figures({"routing": ROUTING})["report_traffic.png"].axes
    bars = {container.get_label(): [bar.get_height() for bar in container] for container in ax.containers}
    counts = ["16", "64", "256"]
    assert list(bars.values()) == [
        pytest.approx([ROUTING[n]["report_bytes_per_replica_s_full"] / 1e3 for n in counts]),
        pytest.approx([ROUTING[n]["report_bytes_per_replica_s_delta"] / 1e3 for n in counts])]
    assert [label.get_text() for label in ax.get_xticklabels()] == [f"{n} replicas" for n in counts]


def test_the_warm_spares_figure_draws_each_run_from_the_step():
    ready_ax, ttft_ax = bench_figures({"warm_spares": SPARES})["warm_spares.png"].axes
    ready, ttft = series(ready_ax), series(ttft_ax)
    for key in ("spares_0", "spares_1"):
        label = f"warm_spares={key.split('_')[1]}"
        t, n = zip(*SPARES[key]["ready"])
        assert ready[label] == ([x - 120.0 for x in t], list(n))
        t, p90 = zip(*SPARES[key]["ttft_p90_bins"])
        assert ttft[label] == ([x - 120.0 for x in t], list(p90))
    assert ttft["SLO"][1] == [1.0, 1.0]


def test_every_figure_is_written_and_a_part_not_run_draws_nothing(tmp_path):
    written = write_plots({"routing": ROUTING, "warm_spares": SPARES}, tmp_path)
    assert sorted(written) == ["report_traffic.png", "routing_scale.png", "warm_spares.png"]
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in written)
    assert bench_figures({"quick": True}) == {}
    assert write_plots({"quick": True}, tmp_path / "none") == []


def test_the_command_wants_a_json_and_a_folder(tmp_path, capsys):
    assert main([]) == 2
    path = tmp_path / "sim_bench.json"
    path.write_text(json.dumps({"routing": {"8": routing_row(0.5)}}))
    assert main([str(path), str(tmp_path / "out")]) == 0
    assert "routing_scale.png" in capsys.readouterr().out
    assert (tmp_path / "out" / "routing_scale.png").read_bytes()[:4] == b"\x89PNG"


SERVED = {"trace_x1": {"real": [0.1, 0.2, 0.3], "sim": [0.1, 0.2, 0.4]},
          "multi_turn_x3_pow2": {"real": [0.2, 2.0], "sim": [0.3, 1.5, 1.7, 1.9]},
          "autoscale": {"real": [0.2, 5.0], "sim": [0.2, 4.0], "replicas_real": [[0.0, 1, 1], [10.0, 1, 3]],
                        "replicas_sim": [[0.0, 1, 1], [9.0, 1, 3], [17.0, 3, 3]]}}


def test_the_served_validation_draws_each_cases_cdfs_and_the_replica_timelines():
    axes = served_validation_figure(SERVED).axes
    cases = ["trace_x1", "multi_turn_x3_pow2", "autoscale"]
    assert [ax.get_title() for ax in axes[:4]] == [*cases, "autoscale: replicas"]
    for ax, name in zip(axes, cases):
        drawn = series(ax)
        for side in ("real", "sim"):
            xs = SERVED[name][side]
            assert drawn[f"{side} ({len(xs)})"] == (xs, pytest.approx([(i + 1) / len(xs) for i in range(len(xs))]))
    timeline = series(axes[3])
    for side in ("real", "sim"):
        rows = SERVED["autoscale"][f"replicas_{side}"]
        assert timeline[f"{side} ready"] == ([r[0] for r in rows], [r[1] for r in rows])
        assert timeline[f"{side} asked for (running + starting)"] == ([r[0] for r in rows], [r[2] for r in rows])


def test_the_served_command_writes_its_figure(tmp_path, capsys):
    path = tmp_path / "served.json"
    path.write_text(json.dumps({"quick": True, "cases": SERVED}))
    assert main(["--served", str(path), str(tmp_path / "served.png")]) == 0
    assert capsys.readouterr().out.strip() == "served.png"
    assert (tmp_path / "served.png").read_bytes()[:4] == b"\x89PNG"
