"""Prometheus metrics for iterserve, on prometheus_client, with one registry per replica.

Each LLMServer replica keeps its own histograms in its own CollectorRegistry (never the global
default: several replicas and tests can share a process) and hands out its metric families, which
pickle, as a snapshot. The ingress gathers the snapshots of every replica (a Serve broadcast) into
one `Exposition`, one series per replica (label `replica`), so `sum by (...)` in PromQL gives the
application's view. Names follow vLLM's where one exists, with `iterserve_` for `vllm:`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

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


class FiniteHistogram(Histogram):
    """A Histogram that ignores NaN and +-Inf: prometheus_client would add them to `_sum`, which
    then stays NaN or infinite for the replica's lifetime."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if math.isfinite(amount):
            super().observe(amount, exemplar)


def collect_families(registry: CollectorRegistry) -> list[Metric]:
    """The registry's families without the `_created` samples prometheus_client adds to histograms
    and counters: iterserve never exposed them, and the library's switch for them is process-wide."""
    families = list(registry.collect())  # fresh Metric objects on every collect
    for family in families:
        family.samples = [s for s in family.samples if s.name != family.name + "_created"]
    return families


def by_label(family: CounterMetricFamily | GaugeMetricFamily,
             values: Mapping[str, float]) -> CounterMetricFamily | GaugeMetricFamily:
    """`family` (declared with one label) with one series per {label value: value}."""
    for label_value, value in values.items():
        family.add_metric([label_value], value)
    return family


class Exposition(Collector):
    """Metric families gathered from many sources, merged by name so that each name has exactly
    one HELP and TYPE, rendered by prometheus_client in text format 0.0.4."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def add(self, family: Metric, labels: Mapping[str, str] | None = None) -> None:
        """Add `family`'s samples with `labels` on each. The gatherer's labels win, so that a
        replica cannot relabel itself into another's series; the first source's help stands."""
        merged = self._families.get(family.name)
        if merged is None:
            merged = self._families[family.name] = Metric(family.name, family.documentation, family.type,
                                                          family.unit)
        elif merged.type != family.type:
            raise ValueError(f"metric {family.name} gathered as {merged.type} and {family.type}")
        extra = dict(labels or {})
        merged.samples.extend(s._replace(labels={**s.labels, **extra}) for s in family.samples)

    def collect(self) -> Iterable[Metric]:
        return self._families.values()

    def render(self) -> str:
        return generate_latest(self).decode()
