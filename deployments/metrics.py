"""Prometheus metrics for iterserve, on prometheus_client, with one registry per replica.

Each LLMServer replica keeps its own histograms in its own CollectorRegistry (never the global
default: several replicas and tests can share a process) and hands out its metric families, which
pickle, as a snapshot. The ingress gathers the snapshots of every replica (a Serve broadcast) and
its own counts into an `IngressMetrics`, and `render_ingress_metrics` writes the /metrics text:
one `Exposition`, one series per replica (label `replica`), so `sum by (...)` in PromQL gives the
application's view. Names follow vLLM's where one exists, with `iterserve_` for `vllm:`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from contracts.priority import Priority

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


# ---- the ingress's /metrics -------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ReplicaMetrics:
    """One LLMServer replica's metric families: what its `metrics_snapshot` returns (it pickles
    across Ray, prometheus_client Metrics included)."""

    replica: str
    model_name: str
    families: list[Metric]


@dataclass(slots=True, frozen=True)
class AdmissionStats:
    """The ingress's admission control (autoscaler/admission.py), by priority."""

    # Requests this ingress sent that have no first token yet.
    num_waiting: Mapping[Priority, int]
    # Requests refused with 429 before being sent, since start.
    num_shed: Mapping[Priority, int]
    # Admitted requests given up with 503 for want of a first token in time, since start.
    num_timed_out: Mapping[Priority, int]
    # The wait for a first token predicted for a new request now.
    predicted_wait_s: float


@dataclass(slots=True, frozen=True)
class FailoverCounters:
    """The ingress's failover across replicas (deployments/handle_backend.py), since start."""

    # Attempts whose replica died, froze or refused; each was retried elsewhere or failed.
    num_failed_attempts: int
    # Requests resumed on another replica after some tokens were sent.
    num_migrated: int


@dataclass(slots=True, frozen=True)
class TokenChannelCounters:
    """The ingress's token channel (deployments/token_channel.py), since start."""

    # Chunks that replicas on this node sent over it.
    num_chunks: int
    # Frames for attempts that had ended, dropped.
    num_dropped: int
    # Connections closed for not being a replica (no secret in time, a bad frame).
    num_refused: int
    # Attempts reading from it now.
    num_open: int


@dataclass(slots=True, frozen=True)
class IngressMetrics:
    """What one ingress replica's /metrics shows, gathered at one scrape."""

    model_name: str
    ingress_id: str
    replicas: Sequence[ReplicaMetrics]
    # Serve's LLMServer replicas by state ("RUNNING", "STARTING", ...).
    replica_states: Mapping[str, int]
    # None for a backend without admission control or without failover.
    admission: AdmissionStats | None
    failover: FailoverCounters | None
    # (endpoint, status code) -> HTTP responses this ingress replica sent.
    http_responses: Mapping[tuple[str, int], int]
    # None for a backend without a token channel.
    token_channel: TokenChannelCounters | None = None


def render_ingress_metrics(metrics: IngressMetrics) -> str:
    """The Prometheus text format 0.0.4 of one scrape: every replica's families labelled with
    model_name and replica, then the ingress's own, labelled with model_name and ingress."""
    exposition = Exposition()
    for replica in metrics.replicas:
        for family in replica.families:
            exposition.add(family, {"model_name": replica.model_name, "replica": replica.replica})
    model = {"model_name": metrics.model_name}
    ingress = {**model, "ingress": metrics.ingress_id}
    states = dict(sorted(metrics.replica_states.items()))
    exposition.add(by_label(GaugeMetricFamily("iterserve_replicas", "LLMServer replicas by state.",
                                              labels=["state"]), states), model)
    if metrics.admission is not None:
        for family in _admission_families(metrics.admission):
            exposition.add(family, ingress)
    if metrics.failover is not None:
        for family in _failover_families(metrics.failover):
            exposition.add(family, ingress)
    if metrics.token_channel is not None:
        for family in _token_channel_families(metrics.token_channel):
            exposition.add(family, ingress)
    responses = CounterMetricFamily("iterserve_http_responses_total", "HTTP responses by endpoint and status.",
                                    labels=["endpoint", "status"])
    for (endpoint, status), count in sorted(metrics.http_responses.items()):
        responses.add_metric([endpoint, str(status)], count)
    exposition.add(responses, {"ingress": metrics.ingress_id})
    return exposition.render()


def _admission_families(stats: AdmissionStats) -> list[Metric]:
    by_priority = [
        ("iterserve_ingress_requests_waiting", GaugeMetricFamily,
         "Requests this ingress sent that have no first token yet.", stats.num_waiting),
        ("iterserve_ingress_requests_shed_total", CounterMetricFamily,
         "Requests this ingress refused with 429 before sending them.", stats.num_shed),
        ("iterserve_ingress_queue_timeouts_total", CounterMetricFamily,
         "Admitted requests given up with 503 for want of a first token in time.", stats.num_timed_out),
    ]
    families: list[Metric] = [by_label(kind(name, help_text, labels=["priority"]),
                                       {p.label: counts[p] for p in Priority})
                              for name, kind, help_text, counts in by_priority]
    families.append(GaugeMetricFamily("iterserve_ingress_predicted_wait_seconds",
                                      "Wait for a first token this ingress predicts for a new request.",
                                      value=stats.predicted_wait_s))
    return families


def _failover_families(counters: FailoverCounters) -> list[Metric]:
    return [
        CounterMetricFamily("iterserve_ingress_failed_attempts_total",
                            "Attempts whose replica died, froze or refused; each was retried elsewhere or failed.",
                            value=counters.num_failed_attempts),
        CounterMetricFamily("iterserve_ingress_requests_migrated_total",
                            "Requests resumed on another replica after some tokens were sent.",
                            value=counters.num_migrated),
    ]


def _token_channel_families(counters: TokenChannelCounters) -> list[Metric]:
    return [
        CounterMetricFamily("iterserve_ingress_token_channel_chunks_total",
                            "Chunks replicas on this node sent over the token channel instead of Serve.",
                            value=counters.num_chunks),
        CounterMetricFamily("iterserve_ingress_token_channel_dropped_total",
                            "Token channel frames for attempts that had ended, dropped.", value=counters.num_dropped),
        CounterMetricFamily("iterserve_ingress_token_channel_refused_total",
                            "Token channel connections closed for not opening as a replica does.",
                            value=counters.num_refused),
        GaugeMetricFamily("iterserve_ingress_token_channel_open_attempts",
                          "Attempts reading chunks from the token channel now.", value=counters.num_open),
    ]
