"""Prometheus text exposition: histogram bucket semantics, and /metrics text that Prometheus reads
back exactly (checked by hand line by line and, when installed, by prometheus_client's parser)."""

import math
import random

import pytest

from deployments.metrics import TTFT_BUCKETS_S, Exposition, Histogram, family_dict

BOUNDS = (0.1, 1.0, 5.0)


def _hist(*values, buckets=BOUNDS) -> Histogram:
    histogram = Histogram(buckets)
    for value in values:
        histogram.observe(value)
    return histogram


# ---- Histogram ------------------------------------------------------------------------------------


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
    snap = _hist(value).snapshot()
    assert snap == {"buckets": [0.1, 1.0, 5.0], "cumulative": cumulative, "sum": value, "count": 1}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_observations_are_ignored(value):
    snap = _hist(0.5, value).snapshot()
    assert (snap["cumulative"], snap["sum"], snap["count"]) == ([0, 1, 1, 1], 0.5, 1)


def test_cumulative_counts_match_a_brute_force_count():
    rng = random.Random(3)
    values = [rng.choice([rng.expovariate(1.0), rng.choice(TTFT_BUCKETS_S)]) for _ in range(2000)]
    snap = _hist(*values, buckets=TTFT_BUCKETS_S).snapshot()
    expected = [sum(v <= bound for v in values) for bound in TTFT_BUCKETS_S] + [len(values)]
    assert snap["cumulative"] == expected
    assert all(a <= b for a, b in zip(snap["cumulative"], snap["cumulative"][1:]))
    assert snap["count"] == len(values) and snap["sum"] == pytest.approx(sum(values))


@pytest.mark.parametrize("buckets", [[], (), [2.0, 1.0], [0.1, 1.0, 1.0], [1, 1.0], [0.5, 2.0, 1.0]])
def test_invalid_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(buckets)


@pytest.mark.parametrize("buckets", [[1.0, math.inf], [1.0, math.nan], [-math.inf, 1.0]])
def test_a_non_finite_bound_is_refused(buckets):
    """+Inf is always the last bucket; an explicit one would render the +Inf series twice."""
    with pytest.raises(ValueError, match="finite"):
        Histogram(buckets)


# ---- Exposition.render ----------------------------------------------------------------------------


def test_render_exact_text():
    exposition = Exposition()
    exposition.add("iterserve_ttft_seconds", "histogram", "Time to first token.", {"replica": "r1"},
                   _hist(0.05, 1.0, 9.0).snapshot())
    exposition.add("iterserve_num_requests_running", "gauge", "Running.", {}, 3)
    exposition.add("iterserve_request_success_total", "counter", "Finished.", {"finished_reason": "stop"}, 7)
    exposition.add("iterserve_request_success_total", "counter", "Finished.", {"finished_reason": "length"}, 2)
    assert exposition.render() == (
        "# HELP iterserve_ttft_seconds Time to first token.\n"
        "# TYPE iterserve_ttft_seconds histogram\n"
        'iterserve_ttft_seconds_bucket{replica="r1",le="0.1"} 1\n'
        'iterserve_ttft_seconds_bucket{replica="r1",le="1.0"} 2\n'
        'iterserve_ttft_seconds_bucket{replica="r1",le="5.0"} 2\n'
        'iterserve_ttft_seconds_bucket{replica="r1",le="+Inf"} 3\n'
        'iterserve_ttft_seconds_sum{replica="r1"} 10.05\n'
        'iterserve_ttft_seconds_count{replica="r1"} 3\n'
        "# HELP iterserve_num_requests_running Running.\n"
        "# TYPE iterserve_num_requests_running gauge\n"
        "iterserve_num_requests_running 3\n"
        "# HELP iterserve_request_success_total Finished.\n"
        "# TYPE iterserve_request_success_total counter\n"
        'iterserve_request_success_total{finished_reason="stop"} 7\n'
        'iterserve_request_success_total{finished_reason="length"} 2\n')


def _replica_snapshot(ttft_values, running, finished):
    return {"families": [
        family_dict("iterserve_ttft_seconds", "histogram", "Time to first token.",
                    [({}, _hist(*ttft_values).snapshot())]),
        family_dict("iterserve_num_requests_running", "gauge", "Running.", [({}, running)]),
        family_dict("iterserve_request_success_total", "counter", "Finished.",
                    [({"finished_reason": reason}, n) for reason, n in finished.items()]),
    ]}


def _two_replicas() -> Exposition:
    exposition = Exposition()
    exposition.add_snapshot(_replica_snapshot([0.05, 2.0], 1, {"stop": 4}), {"model_name": "m", "replica": "a"})
    exposition.add_snapshot(_replica_snapshot([7.0], 0, {"stop": 1, "length": 2}), {"model_name": "m", "replica": "b"})
    return exposition


def test_two_replicas_merge_into_one_family_each():
    lines = _two_replicas().render().splitlines()
    for name, type_ in [("iterserve_ttft_seconds", "histogram"), ("iterserve_num_requests_running", "gauge"),
                        ("iterserve_request_success_total", "counter")]:
        assert lines.count(f"# TYPE {name} {type_}") == 1
        assert sum(line.startswith(f"# HELP {name} ") for line in lines) == 1
    assert 'iterserve_num_requests_running{model_name="m",replica="a"} 1' in lines
    assert 'iterserve_num_requests_running{model_name="m",replica="b"} 0' in lines
    assert 'iterserve_request_success_total{model_name="m",replica="b",finished_reason="length"} 2' in lines
    for replica, count in [("a", 2), ("b", 1)]:
        labels = f'model_name="m",replica="{replica}"'
        assert f'iterserve_ttft_seconds_bucket{{{labels},le="+Inf"}} {count}' in lines
        assert f"iterserve_ttft_seconds_count{{{labels}}} {count}" in lines
    assert 'iterserve_ttft_seconds_sum{model_name="m",replica="a"} 2.05' in lines
    assert 'iterserve_ttft_seconds_bucket{model_name="m",replica="a",le="1.0"} 1' in lines
    # A family's lines are contiguous: the HELP of the next family comes after every sample of this one.
    families = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert families == ["iterserve_ttft_seconds", "iterserve_num_requests_running", "iterserve_request_success_total"]


def test_a_family_with_two_types_is_refused():
    exposition = Exposition()
    exposition.add("iterserve_x", "gauge", "X.", {}, 1)
    with pytest.raises(ValueError, match="iterserve_x"):
        exposition.add("iterserve_x", "counter", "X.", {}, 1)
    with pytest.raises(ValueError):
        exposition.add_snapshot({"families": [family_dict("iterserve_x", "histogram", "X.",
                                                          [({}, _hist(1.0).snapshot())])]}, {"replica": "a"})


def test_label_values_and_help_are_escaped():
    exposition = Exposition()
    exposition.add("iterserve_x", "gauge", 'Path C:\\tmp\nsecond "line"', {"path": 'a\\b"c\nd', "n": 5}, 1)
    assert exposition.render().splitlines() == [
        '# HELP iterserve_x Path C:\\\\tmp\\nsecond "line"',
        "# TYPE iterserve_x gauge",
        'iterserve_x{path="a\\\\b\\"c\\nd",n="5"} 1']


@pytest.mark.parametrize("value, text", [
    (3, "3"), (0, "0"), (2**53 + 1, "9007199254740993"), (True, "1"), (False, "0"),
    (2.0, "2.0"), (0.25, "0.25"), (1e-07, "1e-07"), (0.1 + 0.2, "0.30000000000000004"),
    (math.nan, "NaN"), (math.inf, "+Inf"), (-math.inf, "-Inf"),
])
def test_sample_values_are_rendered_exactly(value, text):
    exposition = Exposition()
    exposition.add("iterserve_x", "gauge", "X.", {}, value)
    assert exposition.render().splitlines()[-1] == f"iterserve_x {text}"


def test_empty_exposition_and_empty_snapshot():
    exposition = Exposition()
    exposition.add_snapshot({}, {"replica": "a"})
    exposition.add_snapshot({"families": [family_dict("iterserve_shed_total", "counter", "Shed.", [])]}, {})
    assert exposition.render() == "\n"


# ---- read back by the reference parser ------------------------------------------------------------


def test_prometheus_client_reads_the_text_back():
    parser = pytest.importorskip("prometheus_client.parser")
    exposition = _two_replicas()
    exposition.add("iterserve_kv_cache_usage_perc", "gauge", 'Usage "now"\nof C:\\', {"path": 'a\\b"c\nd'}, 0.5)
    exposition.add("iterserve_nan", "gauge", "N.", {}, math.nan)
    families = {f.name: f for f in parser.text_string_to_metric_families(exposition.render())}
    # prometheus_client names a counter family without its _total suffix (OpenMetrics style).
    assert {name: f.type for name, f in families.items()} == {
        "iterserve_ttft_seconds": "histogram", "iterserve_num_requests_running": "gauge",
        "iterserve_request_success": "counter", "iterserve_kv_cache_usage_perc": "gauge", "iterserve_nan": "gauge"}
    assert families["iterserve_kv_cache_usage_perc"].documentation == 'Usage "now"\nof C:\\'
    (kv,) = families["iterserve_kv_cache_usage_perc"].samples
    assert (kv.labels, kv.value) == ({"path": 'a\\b"c\nd'}, 0.5)
    assert math.isnan(families["iterserve_nan"].samples[0].value)

    def samples(family):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in families[family].samples}

    success = samples("iterserve_request_success")
    assert success == {
        ("iterserve_request_success_total", (("finished_reason", "stop"), ("model_name", "m"), ("replica", "a"))): 4,
        ("iterserve_request_success_total", (("finished_reason", "stop"), ("model_name", "m"), ("replica", "b"))): 1,
        ("iterserve_request_success_total", (("finished_reason", "length"), ("model_name", "m"),
                                             ("replica", "b"))): 2}
    ttft = samples("iterserve_ttft_seconds")
    for replica, values in [("a", [0.05, 2.0]), ("b", [7.0])]:
        base = (("model_name", "m"), ("replica", replica))
        bounds = {"0.1": 0.1, "1.0": 1.0, "5.0": 5.0, "+Inf": math.inf}
        for le, bound in bounds.items():
            key = ("iterserve_ttft_seconds_bucket", tuple(sorted((*base, ("le", le)))))
            assert ttft[key] == sum(v <= bound for v in values)
        assert ttft[("iterserve_ttft_seconds_count", base)] == len(values)
        assert ttft[("iterserve_ttft_seconds_sum", base)] == pytest.approx(sum(values))
    assert len(ttft) == 2 * (len(bounds) + 2)
