"""Prometheus text exposition for iterserve, without a client library or global registry.

Each LLMServer replica keeps its own histograms and counters and hands out a plain-dict snapshot;
the ingress gathers the snapshots of every replica (a Serve broadcast) and renders them, one
series per replica (label `replica`), so `sum by (...)` in PromQL gives the application's view.
Names follow vLLM's where one exists, with `iterserve_` for `vllm:`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Latency buckets in seconds. TTFT spans a cache hit on a short prompt (ms) to a long queue (min).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# One decode step: a few ms on a GPU, tens of ms on a CPU, longer when prefill chunks share a step.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
                 240.0, 480.0, 960.0)
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0)


class Histogram:
    """Cumulative-bucket histogram; `counts[i]` counts observations <= buckets[i], the last +Inf."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: Sequence[float]) -> None:
        if (not buckets or list(buckets) != sorted(set(buckets))
                or not all(math.isfinite(b) for b in buckets)):
            raise ValueError("histogram buckets must be a non-empty, strictly increasing sequence of finite "
                             "bounds (+Inf is always added)")
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        # Index of the first bucket whose bound is >= value (Prometheus buckets are "le").
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for n in self.counts:
            running += n
            cumulative.append(running)
        return {"buckets": list(self.buckets), "cumulative": cumulative, "sum": self.sum, "count": self.count}


@dataclass(slots=True)
class Family:
    """One metric family: its samples are (labels, value) or (labels, histogram snapshot)."""

    name: str
    type: str  # "counter", "gauge" or "histogram"
    help: str
    samples: list[tuple[dict[str, str], Any]] = field(default_factory=list)


class Exposition:
    """Families gathered from many sources, rendered in Prometheus text format 0.0.4."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def add(self, name: str, type: str, help: str, labels: Mapping[str, str], value: Any) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = Family(name, type, help)
        elif family.type != type:
            raise ValueError(f"metric {name} registered as {family.type} and {type}")
        family.samples.append((dict(labels), value))

    def add_snapshot(self, snapshot: Mapping[str, Any], labels: Mapping[str, str]) -> None:
        """A replica's `metrics_snapshot()`: {"families": [{name, type, help, samples}]}."""
        for family in snapshot.get("families", ()):
            for sample_labels, value in family["samples"]:
                # The gatherer's labels win: a replica cannot relabel itself into another's series.
                merged = {**labels, **{k: v for k, v in sample_labels.items() if k not in labels}}
                self.add(family["name"], family["type"], family["help"], merged, value)

    def render(self) -> str:
        lines: list[str] = []
        for family in self._families.values():
            lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
            lines.append(f"# TYPE {family.name} {family.type}")
            for labels, value in family.samples:
                if family.type == "histogram":
                    lines.extend(_histogram_lines(family.name, labels, value))
                else:
                    lines.append(f"{family.name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def family_dict(name: str, type: str, help: str,
                samples: Iterable[tuple[dict[str, str], Any]]) -> dict[str, Any]:
    return {"name": name, "type": type, "help": help, "samples": list(samples)}


def _histogram_lines(name: str, labels: dict[str, str], snap: Mapping[str, Any]) -> list[str]:
    lines = []
    for bound, cumulative in zip([*snap["buckets"], math.inf], snap["cumulative"]):
        le = "+Inf" if bound == math.inf else _number(bound)
        lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {cumulative}")
    lines.append(f"{name}_sum{_labels(labels)} {_number(snap['sum'])}")
    lines.append(f"{name}_count{_labels(labels)} {snap['count']}")
    return lines


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{key}="{_escape_label(str(value))}"' for key, value in labels.items())
    return "{" + body + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
