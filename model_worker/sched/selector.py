"""The scheduler `SchedulerConfig.batching` names. A module of its own, so that the base scheduler
imports none of the policies built on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from model_worker.config import SchedulerConfig
from model_worker.sched.scheduler import Scheduler
from model_worker.sched.static_scheduler import StaticBatchScheduler


def make_scheduler(config: SchedulerConfig, eos_token_ids: Iterable[int] = (),
                   clock: Callable[[], float] = time.monotonic) -> Scheduler:
    """"continuous" (the iteration-level scheduler) or "static" (request-level batching, a baseline)."""
    if config.batching == "static":
        return StaticBatchScheduler(config, eos_token_ids, clock)
    return Scheduler(config, eos_token_ids, clock)
