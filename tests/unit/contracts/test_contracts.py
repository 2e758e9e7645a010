"""The reports replicas send through Serve's hooks: each converts to what Serve accepts and back."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from autoscaler.serve_policy import replica_loads
from contracts import LoadReport, RoutingReport


def test_a_routing_report_survives_the_round_trip_through_a_plain_dict():
    report = RoutingReport("r0", 7, num_queued=2, num_running=3, num_free_kv_blocks=10, num_total_kv_blocks=64,
                           block_size=16, cached_block_hashes=(5, 6))
    plain = report.to_dict()
    assert plain["cached_block_hashes"] == [5, 6] and all(type(v) in (str, int, bool, list) for v in plain.values())
    assert RoutingReport.from_dict(plain) == report


def test_no_report_yet_is_none_and_a_stopped_engine_needs_no_numbers():
    assert RoutingReport.from_dict({}) is None and RoutingReport.from_dict(None) is None
    stopped = RoutingReport.from_dict(RoutingReport("r1", 3, engine_running=False).to_dict())
    assert stopped is not None and not stopped.engine_running and stopped.cached_block_hashes == ()


def test_a_malformed_routing_report_is_a_clear_error():
    with pytest.raises(ValueError, match="without.*replica_id"):
        RoutingReport.from_dict({"report_seq": 1})
    with pytest.raises(ValueError, match="num_free_kv_blocks must be an int"):
        RoutingReport.from_dict({"replica_id": "r", "report_seq": 1, "num_free_kv_blocks": "many"})
    with pytest.raises(ValueError, match="report_seq must be an int"):
        RoutingReport.from_dict({"replica_id": "r", "report_seq": True})


def test_a_delta_report_survives_the_round_trip_and_an_old_style_report_is_a_snapshot():
    delta = RoutingReport("r0", 8, num_free_kv_blocks=10, cache_seq=40, delta_base_seq=31,
                          stored_block_hashes=(7, 8), removed_block_hashes=(5,))
    plain = delta.to_dict()
    assert plain["stored_block_hashes"] == [7, 8] and plain["removed_block_hashes"] == [5]
    assert all(type(v) in (str, int, bool, list) for v in plain.values())
    parsed = RoutingReport.from_dict(plain)
    assert parsed == delta and not parsed.is_snapshot and parsed.num_hashes == 3
    # A report with neither cache_seq nor a base (from a sender that makes no deltas) is a full snapshot.
    old = RoutingReport.from_dict({"replica_id": "r", "report_seq": 2, "cached_block_hashes": [1, 2]})
    assert old.is_snapshot and old.cache_seq == 0 and old.cached_block_hashes == (1, 2)


@pytest.mark.parametrize("fields, error", [
    ({"stored_block_hashes": [1, "2"]}, "stored_block_hashes must be a list of ints"),
    ({"removed_block_hashes": [True]}, "removed_block_hashes must be a list of ints"),
    ({"cached_block_hashes": "123"}, "cached_block_hashes must be a list of ints"),
    ({"cache_seq": 1.5}, "cache_seq must be an int"),
    ({"delta_base_seq": False}, "delta_base_seq must be an int"),
    ({"delta_base_seq": -2}, "delta_base_seq"),
    ({"cache_seq": 3, "stored_block_hashes": [1]}, "full routing report.*cannot carry"),
    ({"cache_seq": 3, "delta_base_seq": 1, "cached_block_hashes": [1]}, "must carry no cached_block_hashes"),
    ({"cache_seq": 3, "delta_base_seq": 4}, "base <= its cache_seq"),
])
def test_a_routing_report_with_bad_cache_fields_is_refused(fields, error):
    with pytest.raises(ValueError, match=error):
        RoutingReport.from_dict({"replica_id": "r", "report_seq": 1, **fields})


def test_fields_a_newer_replica_adds_are_ignored():
    report = RoutingReport.from_dict({"replica_id": "r", "report_seq": 1, "a_future_field": 1.5})
    assert report == RoutingReport("r", 1)


def test_a_load_report_is_numbers_only_and_leaves_out_an_absent_ttft():
    report = LoadReport(num_waiting_first_token=2, oldest_wait_s=0.5, num_running=3, kv_usage=0.25, num_seats=8,
                        num_shed=1, num_free_kv_blocks=48, num_total_kv_blocks=64)
    metrics = report.to_metrics()
    assert all(type(v) is float for v in metrics.values()) and "ttft_p90_s" not in metrics
    assert set(metrics) == set(LoadReport.metric_names()) - {"ttft_p90_s"}
    assert LoadReport(**{**metrics, "ttft_p90_s": 0.3}).to_metrics()["ttft_p90_s"] == 0.3


@dataclass(frozen=True)
class Sample:  # Serve's TimeStampedValue
    timestamp: float
    value: float


def test_the_autoscaler_reads_exactly_what_a_load_report_sends():
    """A replica's LoadReport, as Serve hands it to the policy, becomes the ReplicaLoad it says."""
    report = LoadReport(num_waiting_first_token=4, oldest_wait_s=1.5, num_running=6, kv_usage=0.75, num_seats=8,
                        num_shed=0, num_free_kv_blocks=16, num_total_kv_blocks=64, ttft_p90_s=0.9)
    raw = {name: {"r": [Sample(10.0, value)]} for name, value in report.to_metrics().items()}
    (load,) = replica_loads(raw, ["r"])
    assert (load.num_waiting_first_token, load.num_running, load.ttft_p90_s, load.oldest_wait_s, load.kv_usage,
            load.num_seats) == (4, 6, 0.9, 1.5, 0.75, 8)


def test_engine_stats_are_typed_and_convert_to_a_plain_dict(make_engine):
    from dataclasses import fields

    from contracts.engine_stats import EngineStats
    from model_worker import SamplingParams
    from tests.unit.conftest import run_to_completion

    engine = make_engine(block_size=4)
    engine.add_request("a", list(range(1, 20)), SamplingParams(max_tokens=3))
    run_to_completion(engine)
    stats = engine.stats(include_block_hashes=True)
    assert isinstance(stats, EngineStats) and stats.requests_finished["length"] == 1
    plain = stats.to_dict()
    assert set(plain) == {f.name for f in fields(EngineStats)}
    assert plain["cached_block_hashes"] == stats.cached_block_hashes
    assert len(stats.cached_block_hashes) == stats.num_cached_kv_blocks > 0
    assert engine.stats().cached_block_hashes is None  # only when asked for: it is every hash


def test_engine_stats_carry_the_caches_changes_since_a_seq_or_all_of_it_after_a_gap(make_engine):
    import pickle

    from model_worker import SamplingParams
    from tests.unit.conftest import run_to_completion

    engine = make_engine(block_size=4)
    engine.add_request("a", list(range(1, 20)), SamplingParams(max_tokens=3))
    run_to_completion(engine)
    first = engine.stats(include_block_hashes=True)
    assert first.cache_seq > 0 and first.block_hashes_since is None
    engine.add_request("b", list(range(50, 70)), SamplingParams(max_tokens=3))
    run_to_completion(engine)
    delta = engine.stats(include_block_hashes=True, block_hashes_since=first.cache_seq)
    assert delta.cached_block_hashes is None and delta.block_hashes_since == first.cache_seq
    assert delta.cache_seq > first.cache_seq and not delta.removed_block_hashes
    assert set(first.cached_block_hashes) | set(delta.stored_block_hashes) == set(engine.scheduler.kv.pool.cached_hashes())
    assert pickle.loads(pickle.dumps(delta)) == delta  # it crosses from the engine process
    assert engine.stats(include_block_hashes=True, block_hashes_since=delta.cache_seq).stored_block_hashes == ()
    engine.reset_prefix_cache()
    gap = engine.stats(include_block_hashes=True, block_hashes_since=delta.cache_seq)
    assert gap.block_hashes_since is None and gap.cached_block_hashes == ()
    with pytest.raises(ValueError, match="needs include_block_hashes"):
        engine.stats(block_hashes_since=0)


def test_the_engines_step_output_is_the_stream_chunk_and_folds_into_one_answer(make_engine):
    import asyncio

    from contracts.serving import GenerationChunk, whole_response
    from model_worker import SamplingParams

    engine = make_engine(block_size=4)
    engine.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=4))
    chunks = []
    while engine.has_unfinished():
        chunks.extend(engine.step())
    assert chunks and all(type(c) is GenerationChunk for c in chunks)
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]

    async def stream():
        yield GenerationChunk("a", keepalive=True)
        for c in chunks:
            yield c

    whole = asyncio.run(whole_response("a", stream()))
    assert whole.token_ids == [t for c in chunks for t in c.token_ids] and len(whole.token_ids) == 4
    assert whole.finish_reason == "length" and whole.num_output_tokens == 4 and whole.num_prompt_tokens == 9
    timings = whole.timings
    assert timings is not None and len(timings.token_times_s) == 4
    assert timings.e2e_s == timings.finished_s - timings.arrival_s and timings.ttft_s <= timings.e2e_s


def test_a_failed_chunk_carries_its_error_into_the_folded_answer():
    from contracts.serving import GenerationChunk

    whole = GenerationChunk("a", token_ids=[1], text="x")
    whole.extend(GenerationChunk("a", finished=True, finish_reason="error", error="boom", num_output_tokens=1))
    assert (whole.text, whole.token_ids, whole.finished, whole.finish_reason, whole.error) == ("x", [1], True, "error", "boom")
