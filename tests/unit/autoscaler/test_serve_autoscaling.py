"""The autoscaler's Serve glue on fake contexts (no Ray): replica reports become ReplicaLoads, the
decision state survives Serve's policy_state, and the app args that configure it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from autoscaler.serve_policy import QueueTTFTPolicy, autoscaling_config, replica_loads
from deployments.app_config import AppArgs


@dataclass(frozen=True)
class Sample:  # the shape of Serve's TimeStampedValue
    timestamp: float
    value: float


@dataclass(frozen=True)
class Replica:  # the shape of Serve's ReplicaID
    unique_id: str


@dataclass
class Context:  # the fields of Serve's AutoscalingContext that the policy reads
    running_replicas: list[Replica]
    raw_metrics: dict[str, dict[Replica, list[Sample]]]
    target_num_replicas: int
    current_time: float
    policy_state: dict[str, Any] = field(default_factory=dict)
    total_queued_requests: float = 0.0
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 4


def report(replicas: list[Replica], t: float, waiting: float, running: float = 1.0,
           ttft: float | None = None, oldest: float = 0.0, kv: float = 0.1) -> dict[str, dict[Replica, list[Sample]]]:
    metrics: dict[str, dict[Replica, list[Sample]]] = {}
    values = {"num_waiting_first_token": waiting, "num_running": running, "oldest_wait_s": oldest, "kv_usage": kv,
              "num_seats": 4}
    if ttft is not None:
        values["ttft_p90_s"] = ttft
    for name, value in values.items():
        # An older sample first: only the newest counts.
        metrics[name] = {r: [Sample(t - 1.0, 0.0), Sample(t, value)] for r in replicas}
    return metrics


def test_newest_report_of_each_replica_becomes_its_load():
    a, b, loading = Replica("a"), Replica("b"), Replica("c")
    metrics = report([a, b], 10.0, waiting=3, running=2, ttft=0.4, oldest=0.7, kv=0.5)
    # b's TTFT p90 came with an older report: no first token in its window since.
    metrics["ttft_p90_s"][b] = [Sample(8.0, 9.0)]
    loads = replica_loads(metrics, [a, b, loading], queued_in_routers=3.0)
    assert [load.replica_id for load in loads] == ["a", "b"]  # c has not reported: not capacity yet
    first, second = loads
    # 3 requests queued in the routers count as one more waiting on each of the 3 replicas.
    assert (first.num_waiting_first_token, first.num_running, first.ttft_p90_s, first.oldest_wait_s, first.kv_usage,
            first.num_seats) == (4, 2, 0.4, 0.7, 0.5, 4)
    assert second.ttft_p90_s is None


def test_policy_scales_up_on_queue_and_keeps_its_state_in_policy_state():
    policy = QueueTTFTPolicy(target_queue_per_replica=4, scale_up_delay_s=2.0)
    replica = Replica("a")
    state: dict[str, Any] = {"serve_internal_key": 1}
    counts = []
    for t in (0.0, 1.0, 2.0, 3.0):
        ctx = Context([replica], report([replica], t, waiting=6, running=4), 1, t, dict(state))
        replicas, state = policy(ctx)
        counts.append(replicas)
    # 6 waiting on one replica is 1.5x the target: held for the 2 s delay, then the 10 requests
    # it holds need 3 replicas of 4 seats.
    assert counts == [1, 1, 3, 3]


def test_serve_bounds_replace_the_configured_ones():
    policy = QueueTTFTPolicy(max_replicas=100)
    replica = Replica("a")
    ctx = Context([replica], report([replica], 0.0, waiting=400), 1, 0.0, capacity_adjusted_max_replicas=2)
    assert policy(ctx)[0] == 2  # panic-level queue, but Serve's max (capacity-adjusted) is 2


def test_autoscaling_config_leaves_delays_to_the_policy():
    config = autoscaling_config(min_replicas=1, max_replicas=3, warm_spares=1, ttft_slo_s=0.5)
    assert (config["upscale_delay_s"], config["downscale_delay_s"]) == (0.0, 0.0)
    assert config["initial_replicas"] == 2  # the spare is loaded from the start
    assert config["policy"] == {"policy_function": "autoscaler.serve_policy:QueueTTFTPolicy",
                                "policy_kwargs": {"warm_spares": 1, "ttft_slo_s": 0.5}}
    with pytest.raises(ValueError, match="warm_spares"):
        autoscaling_config(min_replicas=1, max_replicas=3, warm_spares=-1)


@pytest.mark.parametrize("args,match", [
    ({"num_replicas": 2, "autoscaling": {"max_replicas": 3}}, "not both"),
    ({"autoscaling": {"max_replicas": 2, "min_replicas": 3}}, "max_replicas"),
    ({"autoscaling": {"ttft_slo_s": 0}}, "ttft_slo_s"),
    ({"autoscaling": {"bogus": 1}}, "bogus"),
    ({"ingress_admission": {"batch_max_wait_s": -1}}, "batch_max_wait_s"),
    ({"drain_timeout_s": 0}, "drain_timeout_s"),
])
def test_bad_autoscaling_args_are_refused(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AppArgs.parse(args)
