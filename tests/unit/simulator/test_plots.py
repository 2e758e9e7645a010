"""The simulator benchmark's figures draw from its JSON, and a part not run draws nothing."""

from __future__ import annotations

from simulator.validation.plots import main, write_plots


def routing_row(hit: float) -> dict:
    policy = {"hit_rate": hit, "ttft_p50_s": 0.01, "ttft_p99_s": 0.05}
    return {"prefix_aware": policy, "pow2": policy, "round_robin": policy,
            "report_bytes_per_replica_s_full": 10_000.0, "report_bytes_per_replica_s_delta": 4_000.0}


def test_every_figure_is_drawn_from_a_result(tmp_path):
    result = {"routing": {"16": routing_row(0.9), "64": routing_row(0.8)},
              "warm_spares": {"step_at_s": 120.0, "replica_start_s": 60.0, "slo_s": 1.0,
                              "spares_0": {"ready": [(0.0, 1), (200.0, 4)], "ttft_p90_bins": [(0.0, 0.02), (125.0, 3.0)]},
                              "spares_1": {"ready": [(0.0, 2)], "ttft_p90_bins": [(0.0, 0.02)]}}}
    written = write_plots(result, tmp_path)
    assert sorted(written) == ["report_traffic.png", "routing_scale.png", "warm_spares.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in written)
    assert write_plots({"quick": True}, tmp_path / "none") == []


def test_the_command_wants_a_json_and_a_folder(tmp_path, capsys):
    assert main([]) == 2
    path = tmp_path / "sim_bench.json"
    path.write_text('{"routing": {"8": ' + __import__("json").dumps(routing_row(0.5)) + "}}")
    assert main([str(path), str(tmp_path / "out")]) == 0
    assert "routing_scale.png" in capsys.readouterr().out


def test_the_served_validation_draws_every_case_and_the_timeline(tmp_path, capsys):
    samples = {"trace_x1": {"real": [0.1, 0.2, 0.3], "sim": [0.1, 0.2, 0.4]},
               "multi_turn_x3_pow2": {"real": [0.2, 2.0], "sim": [0.3, 1.5]},
               "autoscale": {"real": [0.2, 5.0], "sim": [0.2, 4.0], "replicas_real": [[0.0, 1, 1], [10.0, 1, 3]],
                             "replicas_sim": [[0.0, 1, 1], [9.0, 1, 3], [17.0, 3, 3]]}}
    path = tmp_path / "served.json"
    path.write_text(__import__("json").dumps({"quick": True, "cases": samples}))
    assert main(["--served", str(path), str(tmp_path / "served.png")]) == 0
    assert capsys.readouterr().out.strip() == "served.png"
    assert (tmp_path / "served.png").stat().st_size > 10_000
