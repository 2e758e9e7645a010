"""How much of the machine's CPU other processes took while a benchmark ran.

On a small shared box (2 cores) a concurrent test run can halve a system's throughput, and a
benchmark that does not say so misleads. This compares the machine's busy CPU time
(/proc/stat) with this process's own (getrusage) over a window. Linux only; elsewhere it reports
None. Standard library only.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    ticks = [int(v) for v in fields[1:]]
    return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / _CLOCK_TICKS_PER_S


def _own_cpu_s() -> float:
    # Children included: nothing we start should count as foreign load.
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(slots=True)
class ContentionWindow:
    """Start it before a run, read foreign_share() after."""

    wall_start_s: float = 0.0
    busy_start_s: float | None = None
    own_start_s: float = 0.0

    @classmethod
    def start(cls) -> ContentionWindow:
        return cls(time.perf_counter(), _machine_busy_s(), _own_cpu_s())

    def foreign_share(self) -> float | None:
        """Share of the machine's CPU capacity used by other processes since start (0..1)."""
        busy = _machine_busy_s()
        wall_s = time.perf_counter() - self.wall_start_s
        if busy is None or self.busy_start_s is None or wall_s <= 0:
            return None
        foreign_s = (busy - self.busy_start_s) - (_own_cpu_s() - self.own_start_s)
        return max(0.0, min(1.0, foreign_s / (wall_s * (os.cpu_count() or 1))))
