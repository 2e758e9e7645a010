"""Prometheus exposition on prometheus_client: histogram bucket semantics, replicas merged into one
/metrics text, and that text read back by prometheus_client's own parser with the right types,
values and labels."""

import asyncio
import dataclasses
import math
import pickle
import random

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from contracts.serving import GenerateRequest
from deployments.llm_server import LLMServer
from contracts.priority import Priority
from deployments.metrics import (E2E_BUCKETS_S, ITL_BUCKETS_S, QUEUE_BUCKETS_S, TTFT_BUCKETS_S, AdmissionStats,
                                 Exposition, FailoverCounters, FiniteHistogram, IngressMetrics, ReplicaMetrics,
                                 by_label, collect_families, render_ingress_metrics)
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from tests.unit.fakes import FakeKVRunner

BOUNDS = (0.1, 1.0, 5.0)


def _parsed(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _values(family) -> dict:
    """{(sample name, sorted labels): value} of a parsed family."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}


def _render(families, labels=None) -> str:
    exposition = Exposition()
    for family in families:
        exposition.add(family, labels)
    return exposition.render()


def _histogram_families(*values, buckets=BOUNDS, name="iterserve_x_seconds", help="X."):
    registry = CollectorRegistry()
    histogram = FiniteHistogram(name, help, buckets=buckets, registry=registry)
    for value in values:
        histogram.observe(value)
    return collect_families(registry)


def _observed(*values, buckets=BOUNDS) -> tuple[list[float], float, float]:
    """(cumulative bucket counts in bound order, +Inf last; sum; count) as Prometheus reads them."""
    (family,) = text_string_to_metric_families(_render(_histogram_families(*values, buckets=buckets)))
    assert family.type == "histogram"
    by_le = {float(s.labels["le"]): s.value for s in family.samples if s.name == "iterserve_x_seconds_bucket"}
    assert list(by_le) == [*buckets, math.inf]
    rest = {s.name: s.value for s in family.samples if s.name != "iterserve_x_seconds_bucket"}
    assert set(rest) == {"iterserve_x_seconds_sum", "iterserve_x_seconds_count"}
    return list(by_le.values()), rest["iterserve_x_seconds_sum"], rest["iterserve_x_seconds_count"]


# ---- FiniteHistogram ------------------------------------------------------------------------------


@pytest.mark.parametrize("value, cumulative", [
    (0.1, [1, 1, 1, 1]),     # equal to a bound: counted in that bucket ("le")
    (0.05, [1, 1, 1, 1]),
    (-3.0, [1, 1, 1, 1]),    # below the first bound
    (0.1000001, [0, 1, 1, 1]),
    (1, [0, 1, 1, 1]),       # an int equal to a float bound
    (5.0, [0, 0, 1, 1]),
    (5.0000001, [0, 0, 0, 1]),  # above the last bound: only in +Inf
    (1e9, [0, 0, 0, 1]),
])
def test_one_observation_lands_in_le_buckets(value, cumulative):
    assert _observed(value) == (cumulative, value, 1)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_observations_are_ignored(value):
    """prometheus_client's own Histogram would make _sum NaN or infinite for good; ours drops them."""
    assert _observed(0.5, value) == ([0, 1, 1, 1], 0.5, 1)


def test_cumulative_counts_match_a_brute_force_count():
    rng = random.Random(3)
    values = [rng.choice([rng.expovariate(1.0), rng.choice(TTFT_BUCKETS_S)]) for _ in range(2000)]
    cumulative, total, count = _observed(*values, buckets=TTFT_BUCKETS_S)
    assert cumulative == [sum(v <= bound for v in values) for bound in TTFT_BUCKETS_S] + [len(values)]
    assert all(a <= b for a, b in zip(cumulative, cumulative[1:]))
    assert count == len(values) and total == pytest.approx(sum(values))


def test_collected_families_have_no_created_series():
    (family,) = _histogram_families(0.5)
    assert {s.name for s in family.samples} == {"iterserve_x_seconds_bucket", "iterserve_x_seconds_sum",
                                                "iterserve_x_seconds_count"}
    assert "_created" not in _render([family])


# ---- a replica's snapshot -------------------------------------------------------------------------


def _server(replica_id: str) -> LLMServer:
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=FakeKVRunner(64, 4, 256, 300))
    return LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", replica_id=replica_id)


def test_replica_snapshots_pickle_and_keep_their_own_counts_and_bounds():
    """Two replicas in one process (each its own registry); snapshots cross Ray as pickles."""
    servers = [_server("a"), _server("b")]

    async def main():
        stream = servers[0].generate_stream(GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=3)))
        assert sum([len(chunk.token_ids) async for chunk in stream]) == 3
        return [await server.metrics_snapshot() for server in servers]

    try:
        snapshots = [pickle.loads(pickle.dumps(s)) for s in asyncio.run(main())]
    finally:
        for server in servers:
            server.shutdown()
    exposition = Exposition()
    for snapshot in snapshots:
        for family in snapshot.families:
            exposition.add(family, {"replica": snapshot.replica})
    families = _parsed(exposition.render())
    for name, bounds in [("iterserve_time_to_first_token_seconds", TTFT_BUCKETS_S),
                         ("iterserve_inter_token_latency_seconds", ITL_BUCKETS_S),
                         ("iterserve_e2e_request_latency_seconds", E2E_BUCKETS_S),
                         ("iterserve_request_queue_time_seconds", QUEUE_BUCKETS_S)]:
        assert families[name].type == "histogram"
        for replica in ("a", "b"):
            les = [s.labels["le"] for s in families[name].samples
                   if s.name == name + "_bucket" and s.labels["replica"] == replica]
            assert [float(le) for le in les] == [*bounds, math.inf]
    counts = {(s.name, s.labels["replica"]): s.value for f in families.values() for s in f.samples
              if s.name.endswith("_count") or s.name == "iterserve_generation_tokens_total"}
    assert counts[("iterserve_time_to_first_token_seconds_count", "a")] == 1
    assert counts[("iterserve_inter_token_latency_seconds_count", "a")] == 2
    assert counts[("iterserve_generation_tokens_total", "a")] == 3
    assert counts[("iterserve_time_to_first_token_seconds_count", "b")] == 0
    assert counts[("iterserve_generation_tokens_total", "b")] == 0
    assert families["iterserve_generation_tokens"].type == "counter"
    assert families["iterserve_kv_cache_usage_perc"].type == "gauge"
    assert not [name for name in families if name.endswith("_created")]


# ---- Exposition -----------------------------------------------------------------------------------


def _replica_families(ttft_values, running, finished):
    return [
        *_histogram_families(*ttft_values, name="iterserve_ttft_seconds", help="Time to first token."),
        GaugeMetricFamily("iterserve_num_requests_running", "Running.", value=running),
        by_label(CounterMetricFamily("iterserve_request_success_total", "Finished.", labels=["finished_reason"]),
                 finished),
    ]


def _two_replicas() -> Exposition:
    exposition = Exposition()
    for replica, families in [("a", _replica_families([0.05, 2.0], 1, {"stop": 4})),
                              ("b", _replica_families([7.0], 0, {"stop": 1, "length": 2}))]:
        for family in families:
            exposition.add(family, {"model_name": "m", "replica": replica})
    return exposition


def test_two_replicas_merge_into_one_family_each():
    text = _two_replicas().render()
    lines = text.splitlines()
    # prometheus_client names a counter family without _total, and writes HELP/TYPE with it.
    for name, type_ in [("iterserve_ttft_seconds", "histogram"), ("iterserve_num_requests_running", "gauge"),
                        ("iterserve_request_success_total", "counter")]:
        assert lines.count(f"# TYPE {name} {type_}") == 1
        assert sum(line.startswith(f"# HELP {name} ") for line in lines) == 1
    # A family's lines are contiguous: every sample comes under its own family's TYPE line.
    families = []
    for line in lines:
        if line.startswith("# TYPE"):
            families.append(line.split()[2])
        elif not line.startswith("#"):
            assert line.startswith(families[-1].removesuffix("_total")), line
    assert families == ["iterserve_ttft_seconds", "iterserve_num_requests_running", "iterserve_request_success_total"]

    parsed = _parsed(text)
    assert _values(parsed["iterserve_num_requests_running"]) == {
        ("iterserve_num_requests_running", (("model_name", "m"), ("replica", "a"))): 1.0,
        ("iterserve_num_requests_running", (("model_name", "m"), ("replica", "b"))): 0.0}
    ttft = _values(parsed["iterserve_ttft_seconds"])
    for replica, values in [("a", [0.05, 2.0]), ("b", [7.0])]:
        base = (("model_name", "m"), ("replica", replica))
        for le, bound in {"0.1": 0.1, "1.0": 1.0, "5.0": 5.0, "+Inf": math.inf}.items():
            key = ("iterserve_ttft_seconds_bucket", tuple(sorted((*base, ("le", le)))))
            assert ttft[key] == sum(v <= bound for v in values)
        assert ttft[("iterserve_ttft_seconds_count", base)] == len(values)
        assert ttft[("iterserve_ttft_seconds_sum", base)] == pytest.approx(sum(values))
    assert len(ttft) == 2 * (len(BOUNDS) + 1 + 2)


def test_the_gatherers_labels_win_over_a_replicas_own():
    family = GaugeMetricFamily("iterserve_x", "X.", labels=["replica", "model_name", "part"])
    family.add_metric(["impostor", "other-model", "weights"], 2.0)
    (sample,) = _parsed(_render([family], {"replica": "a", "model_name": "m"}))["iterserve_x"].samples
    assert sample.labels == {"replica": "a", "model_name": "m", "part": "weights"}


def test_a_family_with_two_types_is_refused():
    exposition = Exposition()
    exposition.add(GaugeMetricFamily("iterserve_x", "X.", value=1))
    with pytest.raises(ValueError, match="iterserve_x"):
        exposition.add(CounterMetricFamily("iterserve_x_total", "X.", value=1), {"replica": "a"})
    (histogram,) = _histogram_families(1.0, name="iterserve_x")
    with pytest.raises(ValueError, match="iterserve_x"):
        exposition.add(histogram, {"replica": "a"})
    assert _values(_parsed(exposition.render())["iterserve_x"]) == {("iterserve_x", ()): 1.0}


def test_label_values_and_help_are_escaped():
    help_text, path, replica = 'Path C:\\tmp\nsecond "line"', 'a\\b"c\nd', 'r"1\\'
    family = GaugeMetricFamily("iterserve_x", help_text, labels=["path"])
    family.add_metric([path], 1)
    text = _render([family], {"replica": replica})
    assert text.splitlines() == [
        '# HELP iterserve_x Path C:\\\\tmp\\nsecond "line"',
        "# TYPE iterserve_x gauge",
        'iterserve_x{path="a\\\\b\\"c\\nd",replica="r\\"1\\\\"} 1.0']
    (parsed,) = text_string_to_metric_families(text)
    assert parsed.documentation == help_text
    assert [(s.labels, s.value) for s in parsed.samples] == [({"path": path, "replica": replica}, 1.0)]


@pytest.mark.parametrize("value, text", [
    (3, "3.0"), (0, "0.0"), (2.0, "2.0"), (0.25, "0.25"), (1e-07, "1e-07"), (0.1 + 0.2, "0.30000000000000004"),
    (math.nan, "NaN"), (math.inf, "+Inf"), (-math.inf, "-Inf"),
])
def test_sample_values_are_rendered_and_read_back_exactly(value, text):
    rendered = _render([GaugeMetricFamily("iterserve_x", "X.", value=value)])
    assert rendered.splitlines()[-1] == f"iterserve_x {text}"
    (sample,) = _parsed(rendered)["iterserve_x"].samples
    assert math.isnan(sample.value) if math.isnan(value) else sample.value == value


def test_empty_exposition_and_empty_families():
    assert Exposition().render() == ""
    assert _render([], {"replica": "a"}) == ""
    # A labelled family with no series yet announces itself only, as prometheus_client does.
    empty = CounterMetricFamily("iterserve_shed_total", "Shed.", labels=["priority"])
    text = _render([empty], {"replica": "a"})
    assert text.splitlines() == ["# HELP iterserve_shed_total Shed.", "# TYPE iterserve_shed_total counter"]
    (family,) = text_string_to_metric_families(text)
    assert (family.name, family.type, family.samples) == ("iterserve_shed", "counter", [])


# ---- the ingress's /metrics ---------------------------------------------------------------------


def _ingress_metrics(admission=None, failover=None) -> IngressMetrics:
    replicas = [ReplicaMetrics(replica, "m", [GaugeMetricFamily("iterserve_num_requests_running", "Running.",
                                                                value=running)])
                for replica, running in (("r1", 3), ("r0", 0))]
    return IngressMetrics(model_name="m", ingress_id="ing", replicas=replicas,
                          replica_states={"STARTING": 1, "RUNNING": 2}, admission=admission, failover=failover,
                          http_responses={("/v1/completions", 429): 1, ("/metrics", 200): 2,
                                          ("/v1/completions", 200): 5})


def test_the_ingress_exposition_names_helps_and_labels():
    """What dashboards and alerts read: every name, help text, type and label of the ingress's own
    families, in order, after the replicas' families (labelled by replica)."""
    admission = AdmissionStats(num_waiting={Priority.INTERACTIVE: 1, Priority.BATCH: 2},
                               num_shed={Priority.INTERACTIVE: 0, Priority.BATCH: 7},
                               num_timed_out={Priority.INTERACTIVE: 3, Priority.BATCH: 0}, predicted_wait_s=2.5)
    text = render_ingress_metrics(_ingress_metrics(admission, FailoverCounters(num_failed_attempts=4, num_migrated=2)))
    ingress = 'ingress="ing",model_name="m"'
    assert text.splitlines() == [
        "# HELP iterserve_num_requests_running Running.",
        "# TYPE iterserve_num_requests_running gauge",
        'iterserve_num_requests_running{model_name="m",replica="r1"} 3.0',
        'iterserve_num_requests_running{model_name="m",replica="r0"} 0.0',
        "# HELP iterserve_replicas LLMServer replicas by state.",
        "# TYPE iterserve_replicas gauge",
        'iterserve_replicas{model_name="m",state="RUNNING"} 2.0',
        'iterserve_replicas{model_name="m",state="STARTING"} 1.0',
        "# HELP iterserve_ingress_requests_waiting Requests this ingress sent that have no first token yet.",
        "# TYPE iterserve_ingress_requests_waiting gauge",
        f'iterserve_ingress_requests_waiting{{{ingress},priority="interactive"}} 1.0',
        f'iterserve_ingress_requests_waiting{{{ingress},priority="batch"}} 2.0',
        "# HELP iterserve_ingress_requests_shed_total Requests this ingress refused with 429 before sending them.",
        "# TYPE iterserve_ingress_requests_shed_total counter",
        f'iterserve_ingress_requests_shed_total{{{ingress},priority="interactive"}} 0.0',
        f'iterserve_ingress_requests_shed_total{{{ingress},priority="batch"}} 7.0',
        "# HELP iterserve_ingress_queue_timeouts_total Admitted requests given up with 503 for want of a first "
        "token in time.",
        "# TYPE iterserve_ingress_queue_timeouts_total counter",
        f'iterserve_ingress_queue_timeouts_total{{{ingress},priority="interactive"}} 3.0',
        f'iterserve_ingress_queue_timeouts_total{{{ingress},priority="batch"}} 0.0',
        "# HELP iterserve_ingress_predicted_wait_seconds Wait for a first token this ingress predicts for a new "
        "request.",
        "# TYPE iterserve_ingress_predicted_wait_seconds gauge",
        f"iterserve_ingress_predicted_wait_seconds{{{ingress}}} 2.5",
        "# HELP iterserve_ingress_failed_attempts_total Attempts whose replica died, froze or refused; each was "
        "retried elsewhere or failed.",
        "# TYPE iterserve_ingress_failed_attempts_total counter",
        f"iterserve_ingress_failed_attempts_total{{{ingress}}} 4.0",
        "# HELP iterserve_ingress_requests_migrated_total Requests resumed on another replica after some tokens "
        "were sent.",
        "# TYPE iterserve_ingress_requests_migrated_total counter",
        f"iterserve_ingress_requests_migrated_total{{{ingress}}} 2.0",
        "# HELP iterserve_http_responses_total HTTP responses by endpoint and status.",
        "# TYPE iterserve_http_responses_total counter",
        'iterserve_http_responses_total{endpoint="/metrics",ingress="ing",status="200"} 2.0',
        'iterserve_http_responses_total{endpoint="/v1/completions",ingress="ing",status="200"} 5.0',
        'iterserve_http_responses_total{endpoint="/v1/completions",ingress="ing",status="429"} 1.0',
    ]


def test_the_token_channel_counts_are_the_ingress_s_own():
    from deployments.metrics import TokenChannelCounters

    metrics = dataclasses.replace(_ingress_metrics(), token_channel=TokenChannelCounters(
        num_chunks=40, num_dropped=2, num_refused=1, num_open=3))
    text = render_ingress_metrics(metrics)
    ingress = 'ingress="ing",model_name="m"'
    for line in (f"iterserve_ingress_token_channel_chunks_total{{{ingress}}} 40.0",
                 f"iterserve_ingress_token_channel_dropped_total{{{ingress}}} 2.0",
                 f"iterserve_ingress_token_channel_refused_total{{{ingress}}} 1.0",
                 f"iterserve_ingress_token_channel_open_attempts{{{ingress}}} 3.0",
                 "# TYPE iterserve_ingress_token_channel_open_attempts gauge"):
        assert line in text.splitlines()


def test_a_backend_without_admission_or_failover_shows_neither():
    names = set(_parsed(render_ingress_metrics(_ingress_metrics())))
    assert names == {"iterserve_num_requests_running", "iterserve_replicas", "iterserve_http_responses"}


def test_a_replica_snapshot_crosses_ray_as_itself():
    family = GaugeMetricFamily("iterserve_x", "X.", value=1)
    snapshot = ReplicaMetrics("a", "m", [family])
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot


# ---- read back by the reference parser ------------------------------------------------------------


def test_prometheus_client_reads_the_text_back():
    exposition = _two_replicas()
    kv = GaugeMetricFamily("iterserve_kv_cache_usage_perc", 'Usage "now"\nof C:\\', labels=["path"])
    kv.add_metric(['a\\b"c\nd'], 0.5)
    exposition.add(kv)
    exposition.add(GaugeMetricFamily("iterserve_nan", "N.", value=math.nan))
    families = _parsed(exposition.render())
    assert {name: f.type for name, f in families.items()} == {
        "iterserve_ttft_seconds": "histogram", "iterserve_num_requests_running": "gauge",
        "iterserve_request_success": "counter", "iterserve_kv_cache_usage_perc": "gauge", "iterserve_nan": "gauge"}
    assert families["iterserve_kv_cache_usage_perc"].documentation == 'Usage "now"\nof C:\\'
    (kv_sample,) = families["iterserve_kv_cache_usage_perc"].samples
    assert (kv_sample.labels, kv_sample.value) == ({"path": 'a\\b"c\nd'}, 0.5)
    assert math.isnan(families["iterserve_nan"].samples[0].value)
    assert _values(families["iterserve_request_success"]) == {
        ("iterserve_request_success_total", (("finished_reason", "stop"), ("model_name", "m"), ("replica", "a"))): 4,
        ("iterserve_request_success_total", (("finished_reason", "stop"), ("model_name", "m"), ("replica", "b"))): 1,
        ("iterserve_request_success_total", (("finished_reason", "length"), ("model_name", "m"),
                                             ("replica", "b"))): 2}
