"""The simulator's event loop and cluster, over a step-time model whose steps take known times."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoscaler.policy import AutoscalerConfig
from loadtest import workloads as wl
from loadtest.results import summarize
from simulator.cluster import REPORT_BASE_BYTES, ClusterConfig, SimCluster, scheduler_config
from simulator.events import EventLoop
from loadtest.traces import BenchRequest, normal_token_ids
from router.policy import RouterConfig


class FixedSteps:
    """Every step takes base_s plus per_token_s per scheduled token."""

    def __init__(self, base_s: float = 0.01, per_token_s: float = 0.0) -> None:
        self.base_s, self.per_token_s = base_s, per_token_s
        self.num_steps = 0

    def predict(self, batch) -> float:
        self.num_steps += 1
        return self.base_s + self.per_token_s * batch.num_scheduled_tokens


def test_event_loop_orders_by_time_then_by_insertion():
    loop = EventLoop()
    seen = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.after(0.5, lambda: loop.after(1.0, seen.append, "after"))
    loop.run()
    assert seen == ["a", "b", "after", "c"] and loop.now == 2.0 and loop.num_events == 5
    with pytest.raises(ValueError):
        loop.at(1.0, seen.append, "past")
    with pytest.raises(ValueError):
        loop.after(-1, seen.append, "negative")


def test_event_loop_stops_at_a_time_or_a_condition():
    loop = EventLoop()
    seen = []
    for t in range(10):
        loop.at(float(t), seen.append, t)
    loop.run(until_s=3.5)
    assert seen == [0, 1, 2, 3] and loop.now == 3.5
    loop.run(stop=lambda: len(seen) >= 6)
    assert seen == [0, 1, 2, 3, 4, 5]
    loop.at(6.5, loop.stop)
    loop.run()
    assert seen == [0, 1, 2, 3, 4, 5, 6] and loop.now == 6.5
    loop.run()
    assert seen == list(range(10))


def test_a_fed_stream_runs_as_if_each_item_had_been_added_first():
    def run(fed: bool) -> list:
        loop, seen = EventLoop(), []
        items = [(2.0, "x"), (1.0, "y"), (1.0, "z"), (3.0, "w")]
        if fed:
            loop.feed(items, seen.append)
        else:
            for t, item in items:
                loop.at(t, seen.append, item)
        loop.at(1.0, seen.append, "later at 1")
        loop.after(0.5, lambda: loop.after(1.5, seen.append, "added at 0.5 for 2"))
        loop.run(until_s=2.5)
        assert len(loop) == 1 and loop.now == 2.5
        loop.run()
        return seen + [loop.num_events]

    assert run(True) == run(False) == ["y", "z", "later at 1", "x", "added at 0.5 for 2", "w", 7]
    loop = EventLoop()
    with pytest.raises(ValueError, match="before now"):
        loop.feed([(-1.0, "a")], print)
    with pytest.raises(ValueError, match="finite"):
        loop.feed([(math.nan, "a"), (1.0, "b")], print)
    loop.feed([], print)
    with pytest.raises(RuntimeError, match="already"):
        loop.feed([], print)


def one_request(prompt_tokens: int, output_tokens: int, arrival_s: float = 0.0, request_id: str = "a") -> BenchRequest:
    return BenchRequest(request_id, tuple(range(1, prompt_tokens + 1)), output_tokens, arrival_s)


def test_one_request_takes_the_steps_the_real_scheduler_gives_it():
    """A 1000-token prompt under a 512-token budget is two prefill steps, the second sampling the
    first token; each later token is one step."""
    steps = FixedSteps(base_s=0.02)
    config = ClusterConfig(scheduler=scheduler_config(max_num_batched_tokens=512))
    run = SimCluster(config, steps).run([one_request(1000, 5, arrival_s=1.0)])
    result = run.results[0]
    assert result.ok and result.output_tokens == 5
    assert result.ttft_s == pytest.approx(2 * 0.02)
    assert result.e2e_s == pytest.approx(6 * 0.02)
    assert result.chunk_times_s == pytest.approx([1.04, 1.06, 1.08, 1.10, 1.12])
    assert run.counters["steps"] == 6 and steps.num_steps == 6


class WakingSteps(FixedSteps):
    """FixedSteps whose first step after an idle spell costs idle_wake_s more."""

    def __init__(self, base_s: float, idle_wake_s: float) -> None:
        super().__init__(base_s)
        self.idle_wake_s = idle_wake_s


def test_only_a_step_that_starts_an_idle_replica_pays_its_wake():
    """Two requests apart (each finds the replica idle) and a third arriving while the second
    runs (it joins a busy replica): the first steps of the two apart are late by the wake, the
    third's is not, and no busy step pays it."""
    steps = WakingSteps(base_s=0.02, idle_wake_s=0.005)
    limits = scheduler_config(max_num_batched_tokens=512)
    workload = [one_request(16, 3, 0.0, "a"), one_request(16, 3, 1.0, "b"), one_request(16, 3, 1.03, "c")]
    by_id = {r.request_id: r for r in SimCluster(ClusterConfig(scheduler=limits), steps).run(workload).results}
    assert by_id["a"].ttft_s == pytest.approx(0.025)
    assert by_id["a"].e2e_s == pytest.approx(0.025 + 2 * 0.02)
    assert by_id["b"].ttft_s == pytest.approx(0.025)
    assert by_id["c"].ttft_s == pytest.approx(1.065 - 1.03)  # joins b's third step, at 1.045
    plain = {r.request_id: r for r in SimCluster(ClusterConfig(scheduler=limits), FixedSteps(0.02)).run(workload).results}
    assert plain["a"].ttft_s == pytest.approx(0.02)


def test_continuous_batching_lets_a_short_request_finish_first():
    steps = FixedSteps(base_s=0.01)
    workload = [one_request(16, 200, 0.0, "long"), one_request(16, 3, 0.05, "short")]
    run = SimCluster(ClusterConfig(), steps).run(workload)
    by_id = {r.request_id: r for r in run.results}
    assert by_id["short"].finish_s < by_id["long"].finish_s
    assert by_id["short"].ttft_s == pytest.approx(0.01, abs=0.011)  # joins at the next step


def shared_prefix_workload(num_requests: int = 400, rate: float = 40.0):
    pool = normal_token_ids(32000, [])
    return wl.shared_prefix(8, num_requests // 8, 512, 16, 16, wl.arrivals(num_requests, rate, "poisson", 0), pool, seed=0)


def test_round_robin_spreads_evenly_and_prefix_aware_keeps_prefixes_together():
    workload = shared_prefix_workload()
    runs = {}
    for policy in ("round_robin", "prefix_aware"):
        # Caches of 80 blocks hold about two of the eight 32-block prefixes: spreading them evicts.
        # 3 replicas: round-robin then sends every prefix to every replica (with 4, prefix i % 8 would
        # always meet replica i % 4).
        config = ClusterConfig(scheduler=scheduler_config(num_kv_blocks=80, max_num_seqs=8), num_replicas=3,
                               router=RouterConfig(policy=policy))
        runs[policy] = SimCluster(config, FixedSteps(0.005, 0.00002)).run(workload)
        assert all(r.ok for r in runs[policy].results)
    hit = {policy: run.counters["cached_tokens"] / run.counters["prompt_tokens"] for policy, run in runs.items()}
    assert hit["prefix_aware"] > hit["round_robin"] + 0.2, hit
    # Only the prefix-aware router needs the hash sets: the other reports are counts alone.
    round_robin = runs["round_robin"].counters
    assert round_robin["report_bytes"] == REPORT_BASE_BYTES * round_robin["reports"]
    assert runs["prefix_aware"].counters["report_bytes"] > 2 * round_robin["report_bytes"]


def test_admission_refuses_past_its_queue_limit():
    workload = [one_request(16, 50, 0.0, f"r{i}") for i in range(40)]
    config = ClusterConfig(scheduler=scheduler_config(max_num_seqs=4), admission={"max_waiting_requests": 10})
    run = SimCluster(config, FixedSteps(0.01)).run(workload)
    statuses = [r.status for r in run.results]
    assert statuses.count(503) > 0 and statuses.count(200) > 0 and set(statuses) == {200, 503}
    assert run.counters["refused"] == statuses.count(503)


def test_autoscaling_adds_replicas_that_serve_only_after_they_start():
    pool = normal_token_ids(32000, [])
    times = wl.step_arrivals([(20.0, 2.0), (40.0, 20.0)], seed=0)
    workload = wl.synthetic(len(times), wl.LengthDist("fixed", 64, 64, 64), wl.LengthDist("fixed", 64, 64, 64),
                            times, pool, seed=0)
    config = ClusterConfig(scheduler=scheduler_config(max_num_seqs=8), num_replicas=1,
                           autoscaling=AutoscalerConfig(min_replicas=1, max_replicas=8, scale_up_delay_s=1.0),
                           replica_start_s=10.0)
    run = SimCluster(config, FixedSteps(0.02)).run(workload)
    assert all(r.ok for r in run.results)
    decisions = run.decisions
    first_up = next(d for d in decisions if d["target"] > 1)
    first_ready = next(d for d in decisions if d["ready"] > 1)
    assert first_ready["t_s"] >= first_up["t_s"] + 10.0 - 1.0  # decisions are 1 s apart
    assert max(d["ready"] for d in decisions) > 1
    assert run.timeline and {"t_s", "replicas", "num_waiting", "num_running"} <= set(run.timeline[0])


def test_multi_turn_sends_each_turn_after_the_previous_one():
    pool = normal_token_ids(32000, [])
    workload = wl.multi_turn(3, 3, 64, 16, 8, [0.0, 0.1, 0.2], pool, seed=0, think_time_s=0.5)
    run = SimCluster(ClusterConfig(num_replicas=2), FixedSteps(0.01)).run(workload)
    by_id = {r.request_id: r for r in run.results}
    for c in range(3):
        for t in range(1, 3):
            before, after = by_id[f"conv-{c}-turn-{t - 1}"], by_id[f"conv-{c}-turn-{t}"]
            assert after.sent_s == pytest.approx(before.finish_s + 0.5)
    summary = summarize(run.results)
    assert summary["num_ok"] == 9


def test_a_run_cut_off_reports_open_requests_as_unfinished():
    run = SimCluster(ClusterConfig(), FixedSteps(0.1)).run([one_request(16, 1000)], max_duration_s=5.0)
    assert not run.results[0].ok and run.results[0].finish_s is None
    assert math.isclose(run.duration_s, 5.0)
    assert np.isfinite(run.counters["busy_s"])


def test_delta_reports_route_exactly_as_full_snapshots_for_far_fewer_bytes():
    """The real report builder and PrefixIndex.apply_report in the loop: with deltas the router's
    index is the same as with a snapshot every period, so every decision and every figure is the
    same, for a fraction of the report bytes."""
    workload = shared_prefix_workload(600, 60.0)
    runs = {}
    for mode in ("full", "delta"):
        config = ClusterConfig(scheduler=scheduler_config(num_kv_blocks=400, max_num_seqs=8), num_replicas=3,
                               report_mode=mode, routing_stats_period_s=0.2)
        runs[mode] = SimCluster(config, FixedSteps(0.005, 0.00002)).run(workload)
    full, delta = runs["full"], runs["delta"]
    assert [r.finish_s for r in full.results] == [r.finish_s for r in delta.results]
    assert full.counters["cached_tokens"] == delta.counters["cached_tokens"]
    assert delta.counters["report_hashes"] < full.counters["report_hashes"] / 3
    # Each delta run also counts what its reports would have cost as snapshots: the full run's bytes.
    assert delta.counters["snapshot_bytes"] == full.counters["report_bytes"] == full.counters["snapshot_bytes"]
    with pytest.raises(ValueError, match="report_mode"):
        ClusterConfig(report_mode="sometimes")


def test_capacity_plan_finds_the_fewest_replicas_meeting_the_slo(monkeypatch):
    """Bisection over replica counts: the answer meets the SLO and one replica fewer does not."""
    import argparse

    from loadtest.results import SLO
    from simulator import cli
    pool = normal_token_ids(32000, [])
    fixed = wl.LengthDist("fixed", 64, 64, 64)
    workload = wl.synthetic(300, fixed, fixed, wl.arrivals(300, 30.0, "poisson", 0), pool, seed=0)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["simulate", "--max-replicas", "16", "--max-num-seqs", "4", "--slo-ttft", "0.5"])
    slo = SLO(ttft_s=0.5)
    monkeypatch.setattr(cli, "summary_line", lambda run: run["label"])
    fewest, runs = cli.plan(workload, args, FixedSteps(0.02), "round_robin", slo, 30.0)
    by_count = {int(run["series"].split("x")[-1]): run for run in runs}
    assert fewest is not None and 1 < fewest < 16
    assert cli.meets(by_count[fewest]["summary"], slo)
    fewer = cli.simulate(workload, cli.cluster_config(args, fewest - 1, "round_robin"), FixedSteps(0.02), "x", "x",
                         30.0, slo, args.max_duration)
    assert not cli.meets(fewer["summary"], slo)


def test_request_latency_counts_in_ttft_and_e2e_but_not_between_tokens():
    steps = FixedSteps(base_s=0.02)
    limits = scheduler_config(max_num_batched_tokens=512)
    plain = SimCluster(ClusterConfig(scheduler=limits), steps).run([one_request(100, 5)]).results[0]
    late = SimCluster(ClusterConfig(scheduler=limits, request_latency_s=0.005), steps).run(
        [one_request(100, 5)]).results[0]
    assert late.ttft_s == pytest.approx(plain.ttft_s + 0.005)
    assert late.e2e_s == pytest.approx(plain.e2e_s + 0.005)
    assert late.tpot_s == pytest.approx(plain.tpot_s)
    with pytest.raises(ValueError, match="request_latency_s"):
        ClusterConfig(request_latency_s=-1.0)


def test_the_run_turns_the_cycle_collector_off_and_back_on():
    import gc

    seen = []

    class Probe(FixedSteps):
        def predict(self, batch) -> float:
            seen.append(gc.isenabled())
            return super().predict(batch)

    assert gc.isenabled()
    SimCluster(ClusterConfig(), Probe()).run([one_request(100, 3)])
    assert seen and not any(seen) and gc.isenabled()


def test_at_the_default_limits_a_replica_sheds_batch_from_128_waiting_and_everything_at_256():
    # Every request arrives before the first step ends, so none has a first token yet.
    batch = [BenchRequest(f"b{i}", tuple(range(16)), 4, 0.0, priority="batch") for i in range(150)]
    interactive = [BenchRequest(f"i{i}", tuple(range(16)), 4, 0.001, priority="interactive") for i in range(150)]
    run = SimCluster(ClusterConfig(scheduler=scheduler_config(max_num_seqs=4)), FixedSteps(1.0)).run(batch + interactive)
    by_id = {r.request_id: r.status for r in run.results}
    assert [by_id[b.request_id] for b in batch].count(503) == 150 - 128
    assert [by_id[i.request_id] for i in interactive].count(503) == 150 - 128
    assert run.counters["refused"] == 2 * (150 - 128)
