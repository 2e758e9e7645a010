"""bench_serving_path's pure parts: py-spy's collapsed stacks into shares, and the engine-side
means from two scrapes of the replicas' histograms."""

from __future__ import annotations

import pytest

from loadtest.benchmarks.bench_serving_path import _delta_mean, top_functions


def test_collapsed_stacks_give_self_and_inclusive_shares(tmp_path):
    path = tmp_path / "stacks.txt"
    path.write_text("thread;run (a.py:1);step (b.py:2);forward (c.py:3) 6\n"
                    "thread;run (a.py:1);step (b.py:2) 2\n"
                    "thread;loop (d.py:9) 2\n"
                    "garbage line\n")
    top = top_functions(path)
    assert top["samples"] == 10
    assert dict(top["self"]) == {"forward": 0.6, "step": 0.2, "loop": 0.2}
    assert dict(top["inclusive"])["step"] == 0.8 and dict(top["inclusive"])["thread"] == 1.0


def test_a_missing_profile_says_so_instead_of_raising(tmp_path):
    assert top_functions(tmp_path / "none.txt")["samples"] == 0


def test_engine_side_means_come_from_the_difference_of_two_scrapes():
    before = {"itl_s": (10.0, 100.0), "ttft_s": (5.0, 10.0)}
    after = {"itl_s": (14.0, 120.0), "ttft_s": (5.0, 10.0)}
    assert _delta_mean(before, after, "itl_s") == pytest.approx(0.2)
    assert _delta_mean(before, after, "ttft_s") is None  # nothing observed in between


def test_ours_over_the_peer_is_a_ratio_of_the_same_figures_and_none_when_missing():
    from loadtest.benchmarks.bench_serving_path import versus_peer

    figures = {"http_ttft_p50_ms": 300.0, "http_tpot_p50_ms": 40.0, "http_itl_p50_ms": 30.0, "http_tokens_per_s": 120.0,
               "vllm_http_ttft_p50_ms": 400.0, "vllm_http_tpot_p50_ms": 50.0, "vllm_http_itl_p50_ms": None,
               "vllm_http_tokens_per_s": 100.0}
    ratios = versus_peer(figures, "vllm")
    assert ratios["ttft_p50_over_vllm"] == pytest.approx(0.75)
    assert ratios["tpot_p50_over_vllm"] == pytest.approx(0.8)
    assert ratios["tokens_per_s_over_vllm"] == pytest.approx(1.2)
    assert ratios["itl_p50_over_vllm"] is None


def test_served_modes_are_checked_and_kept_in_order():
    from loadtest.benchmarks.bench_serving_path import parse_args

    assert parse_args(["--served", "process,thread"]).served == ["process", "thread"]
    assert parse_args([]).served == ["process"]
    for bad in ("gpu", "process,process", ","):
        with pytest.raises(SystemExit):
            parse_args(["--served", bad])


def test_serving_paths_are_checked_and_each_combination_gets_its_own_prefix():
    from loadtest.benchmarks.bench_serving_path import parse_args, served_label

    args = parse_args(["--served", "process,thread", "--serving-path", "proxy,direct"])
    assert args.serving_path == ["proxy", "direct"]
    assert parse_args([]).serving_path == ["proxy"]
    labels = [served_label(args, mode, path) for mode in args.served for path in args.serving_path]
    assert labels == ["", "direct", "thread", "thread_direct"]
    for bad in ("", "direct,direct", "nginx"):
        with pytest.raises(SystemExit):
            parse_args(["--serving-path", bad])


def test_vllms_client_draws_the_burst_apart_from_the_light_run():
    """vLLM's random dataset draws prompt i alike for any prompt count under one seed: a burst drawn
    with the light run's seed would begin with the light run's prompts, which the server's prefix
    cache then holds (29 of 64 at 30 light requests, measured against `vllm bench serve` 0.32)."""
    from loadtest.benchmarks.bench_serving_path import parse_args, vllm_client_plan

    plan = vllm_client_plan(parse_args(["--peer", "vllm", "--vllm-client", "--rate", "0.5", "--rate-requests", "7",
                                        "--num-requests", "9", "--seed", "3"]))
    assert [(run, rate, count) for run, rate, count, _ in plan] == [("light", 0.5, 7), ("burst", None, 9)]
    seeds = [seed for *_, seed in plan]
    assert len(set(seeds)) == 2 and seeds[0] == 3


def test_vllms_offline_burst_is_read_beside_its_served_one_and_ours():
    from loadtest.benchmarks.bench_serving_path import vllm_offline_figures

    figures = {"vllm_http_tokens_per_s": 450.0, "offline_tokens_per_s": 700.0}
    got = vllm_offline_figures(figures, {"tokens_per_s": [480.0, 520.0]})
    assert got == {"vllm_offline_tokens_per_s": 500.0, "vllm_offline_tokens_per_s_rounds": [480.0, 520.0],
                   "vllm_http_over_vllm_offline_throughput": 0.9, "offline_tokens_per_s_over_vllm_offline": 1.4}
    assert vllm_offline_figures(figures, {"error": "exited with code 3"}) == {"vllm_offline_error": "exited with code 3"}
