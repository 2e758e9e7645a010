"""The autoscaler inside Ray Serve: `AutoscalingConfig(policy=AutoscalingPolicy(...))` calls
`QueueTTFTPolicy` on the controller every control-loop tick (0.1 s) with the replicas' metrics.

It only converts: the newest value of each replica's `record_autoscaling_stats` report becomes an
`autoscaler.policy.ReplicaLoad`, Serve's bounds (min/max replicas, adjusted for cluster capacity)
replace the config's, and the decision state travels in Serve's `policy_state` dict. Requests
queued in the callers' routers (Serve's `total_queued_requests`) are left out: handles report them
every 10 s, so a router's momentary queue at startup read as 8 waiting per replica for seconds
and scaled 1 -> 4 at 1x load; with a high max_ongoing_requests they are transient anyway.
Serve's own delays and factors must be neutral (upscale_delay_s 0, downscale_delay_s 0, no
factors): `autoscaler.policy.decide` applies its own, and `autoscaling_config()` builds such a config.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from autoscaler.policy import AutoscalerConfig, ReplicaLoad, decide, state_from_dict, to_dict

logger = logging.getLogger("ray.serve")

# How often each replica's metrics reach the controller, and how much history Serve keeps. Serve's
# defaults (10 s pushes, 30 s look-back) are why its autoscaler reacts in tens of seconds; a
# replica's report is a few numbers, so pushing twice a second costs nothing.
METRICS_INTERVAL_S = 0.5
LOOK_BACK_PERIOD_S = 2.5


class QueueTTFTPolicy:
    """Serve's autoscaling policy object: built once with `policy_kwargs` (AutoscalerConfig
    fields), then called with an AutoscalingContext. Keeps the last decision for its log line."""

    def __init__(self, **config: Any) -> None:
        self.config = AutoscalerConfig(**config)
        self._last_reason = ""

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        loads = replica_loads(ctx.raw_metrics or {}, ctx.running_replicas)
        config = dataclasses.replace(self.config, min_replicas=ctx.capacity_adjusted_min_replicas,
                                     max_replicas=max(ctx.capacity_adjusted_max_replicas,
                                                      ctx.capacity_adjusted_min_replicas, 1))
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        decision = decide(loads, ctx.target_num_replicas, now_s, config, state_from_dict(ctx.policy_state))
        if decision.num_replicas != ctx.target_num_replicas and decision.reason != self._last_reason:
            logger.info(f"autoscaler: {ctx.target_num_replicas} -> {decision.num_replicas} replicas "
                        f"({decision.reason})")
        self._last_reason = decision.reason
        return decision.num_replicas, to_dict(decision.state)


def replica_loads(raw_metrics: Mapping[str, Mapping[Any, Sequence[Any]]], running_replicas: Sequence[Any],
                  queued_in_routers: float = 0.0) -> list[ReplicaLoad]:
    """A ReplicaLoad per running replica that has reported, from each metric's newest sample.
    `ttft_p90_s` counts only if it came with the newest report (a replica leaves it out when no
    first token arrived in its window)."""
    extra_waiting = queued_in_routers / len(running_replicas) if running_replicas else 0.0
    loads = []
    for replica in running_replicas:
        newest = {name: _newest(series.get(replica)) for name, series in raw_metrics.items()}
        waiting = newest.get("num_waiting_first_token")
        if waiting is None:
            continue  # no report yet: a replica still loading its weights is not capacity
        report_s = waiting[0]
        ttft = newest.get("ttft_p90_s")
        loads.append(ReplicaLoad(
            replica_id=str(getattr(replica, "unique_id", replica)),
            num_waiting_first_token=math.ceil(waiting[1] + extra_waiting),
            num_running=int(_value(newest.get("num_running"))),
            ttft_p90_s=ttft[1] if ttft is not None and ttft[0] >= report_s else None,
            oldest_wait_s=_value(newest.get("oldest_wait_s")),
            kv_usage=_value(newest.get("kv_usage")),
            num_seats=int(_value(newest.get("num_seats"))),
        ))
    return loads


def autoscaling_config(min_replicas: int, max_replicas: int, initial_replicas: int | None = None,
                       **policy: Any) -> dict[str, Any]:
    """A Serve `autoscaling_config` dict that runs QueueTTFTPolicy with `policy` (AutoscalerConfig
    fields, min/max excluded) and leaves every delay and factor to it."""
    AutoscalerConfig(min_replicas=min_replicas, max_replicas=max_replicas, **policy)  # fail before deploying
    config: dict[str, Any] = {
        "min_replicas": min_replicas, "max_replicas": max_replicas,
        "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
        "metrics_interval_s": METRICS_INTERVAL_S, "look_back_period_s": LOOK_BACK_PERIOD_S,
        "policy": {"policy_function": f"{__name__}:QueueTTFTPolicy", "policy_kwargs": dict(policy)},
    }
    # Start with the spares already loaded, not one decision later.
    spares = policy.get("warm_spares", 0)
    config["initial_replicas"] = initial_replicas if initial_replicas is not None else min(min_replicas + spares,
                                                                                         max_replicas)
    return config


def _newest(series: Sequence[Any] | None) -> tuple[float, float] | None:
    if not series:
        return None
    sample = max(series, key=lambda s: s.timestamp)
    return sample.timestamp, float(sample.value)


def _value(sample: tuple[float, float] | None) -> float:
    return 0.0 if sample is None else sample[1]
