"""The parallel simulator (replicas in worker processes) against SimCluster in one process."""

from __future__ import annotations

import dataclasses
import os

import pytest

from autoscaler.policy import AutoscalerConfig
from loadtest import workloads as wl
from simulator.validation.bench import scale_workload
from simulator.cli import load_step_model
from simulator.cluster import ClusterConfig, SimCluster, scheduler_config
from simulator.parallel import ParallelCluster
from loadtest.traces import normal_token_ids
from router.policy import RouterConfig

LINK_S = 0.001


def config(policy: str = "prefix_aware", max_num_seqs: int = 32, **overrides) -> ClusterConfig:
    limits = scheduler_config(num_kv_blocks=600, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    base = dict(num_replicas=5, scheduler=limits, router=RouterConfig(policy=policy), routing_stats_period_s=0.05,
                link_latency_s=LINK_S, report_delay_s=0.002, seed=3)
    base.update(overrides)
    return ClusterConfig(**base)


def outcome(run) -> tuple:
    """Everything a run reports but its event count (a shard has a report event of its own)."""
    counters = {k: v for k, v in run.counters.items() if k != "events"}
    return [dataclasses.astuple(r) for r in run.results], run.duration_s, run.timeline, counters


def both(cfg: ClusterConfig, workload, workers: int = 2) -> tuple[tuple, tuple]:
    model = load_step_model("llama3-8b-h100")
    return outcome(SimCluster(cfg, model).run(workload)), outcome(ParallelCluster(cfg, model, workers).run(workload))


@pytest.mark.parametrize("policy", ["prefix_aware", "pow2", "round_robin"])
def test_every_request_comes_out_as_in_one_process(policy):
    # 600 blocks a replica: the caches fill, evict and preempt.
    serial, parallel = both(config(policy), scale_workload(1500, 150.0, seed=1))
    assert parallel == serial
    results, _, timeline, counters = serial
    assert all(r[4] == 200 for r in results) and counters["preemptions"] > 0 and len(timeline) > 100


def test_conversations_and_refusals_come_out_as_in_one_process():
    pool = normal_token_ids(32000, [])
    arrivals = wl.arrivals(60, 20.0, "poisson", 0)
    workload = wl.multi_turn(60, 3, 256, 32, 24, arrivals, pool, 0, think_time_s=0.3, num_system_prompts=4)
    cfg = config(num_replicas=3, admission={"max_waiting_requests": 2}, max_num_seqs=4,
                 request_latency_s=0.005, record_token_times=True)
    serial, parallel = both(cfg, workload, workers=3)
    assert parallel == serial
    statuses = {r[4] for r in serial[0]}
    assert statuses == {200, 503}  # some refused, the rest served


def test_more_workers_than_replicas_and_one_worker_give_the_same_run():
    workload = scale_workload(200, 40.0, seed=2)
    serial, parallel = both(config(num_replicas=2), workload, workers=3)
    assert parallel == serial
    assert both(config(num_replicas=2), workload, workers=1)[1] == serial


def test_a_link_latency_delays_the_replica_and_the_router():
    workload = scale_workload(50, 10.0, seed=4)
    model = load_step_model("llama3-8b-h100")
    at_once = SimCluster(config(num_replicas=1, link_latency_s=0.0), model).run(workload).results
    later = SimCluster(config(num_replicas=1, link_latency_s=0.01), model).run(workload).results
    # One replica: every request reaches it 10 ms later, so the same steps run 10 ms later.
    assert all(r.ok for r in at_once + later)
    assert all(abs(b.ttft_s - a.ttft_s - 0.01) < 1e-9 for a, b in zip(at_once, later))
    assert all(abs(b.tpot_s - a.tpot_s) < 1e-9 for a, b in zip(at_once, later))


@pytest.mark.parametrize("overrides, words", [
    (dict(link_latency_s=0.0), "link_latency_s > 0"),
    (dict(report_delay_s=0.0005), "report_delay_s >= link_latency_s"),
    (dict(autoscaling=AutoscalerConfig(min_replicas=1, max_replicas=4)), "fixed replica count"),
])
def test_a_parallel_run_refuses_what_it_cannot_run_the_same(overrides, words):
    with pytest.raises(ValueError, match=words):
        ParallelCluster(config(**overrides), load_step_model("llama3-8b-h100"))
    with pytest.raises(ValueError, match="workers"):
        ParallelCluster(config(), load_step_model("llama3-8b-h100"), workers=0)


class Broken:
    """A step model that fails on its first step."""

    def predict(self, batch) -> float:
        raise ZeroDivisionError("a broken step model")


def test_a_worker_error_ends_the_run_with_its_traceback():
    with pytest.raises(RuntimeError, match="ZeroDivisionError: a broken step model"):
        ParallelCluster(config(), Broken()).run(scale_workload(20, 10.0, seed=0))


class Dies:
    """A step model whose process dies on its first step, as a worker killed would."""

    def predict(self, batch) -> float:
        os._exit(3)


def test_a_worker_that_dies_ends_the_run_with_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="simulator worker"):
        ParallelCluster(config(), Dies()).run(scale_workload(20, 10.0, seed=0))


def test_the_simulate_command_runs_with_workers_to_the_same_summary():
    import argparse

    from loadtest.results import SLO
    from simulator import cli
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    base = ["simulate", "--link-latency", "0.001", "--report-delay", "0.001", "--profile", "llama3-8b-h100"]
    one = parser.parse_args(base)
    two = parser.parse_args(base + ["--workers", "2"])
    workload = scale_workload(300, 60.0, seed=5)
    model = load_step_model("llama3-8b-h100")
    runs = [cli.simulate(workload, cli.cluster_config(args, 3, "prefix_aware"), model, "x", "x", 60.0, SLO(),
                         args.max_duration, args.workers) for args in (one, two)]
    assert runs[0]["summary"] == runs[1]["summary"] and runs[0]["results"] == runs[1]["results"]
    with pytest.raises(ValueError, match="max-duration"):
        cli.simulate(workload, cli.cluster_config(two, 3, "prefix_aware"), model, "x", "x", 60.0, SLO(), 10.0, 2)
