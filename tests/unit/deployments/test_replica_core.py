"""ReplicaCore: a replica's admission, request bookkeeping and reports, with a fake clock and
engine stats built by a real engine (the same class runs in LLMServer and in the simulator)."""

from __future__ import annotations

import pytest

from contracts import RoutingReport
from contracts.priority import Priority
from deployments.replica_core import ReplicaCore, ReplicaOverloaded
from model_worker import EngineConfig, LLMEngine, SamplingParams
from model_worker.config import SchedulerConfig
from router.prefix_index import PrefixIndex
from tests.unit.fakes import FakeClock, FakeKVRunner

LIMITS = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)


def make_core(clock=None, **admission) -> ReplicaCore:
    return ReplicaCore("r0", LIMITS, clock or FakeClock(), admission=admission)


def test_default_limits_refuse_batch_from_128_waiting_and_interactive_at_256():
    core = make_core()
    admitted = [core.admit(f"b{n}", Priority.BATCH) for n in range(128)]
    with pytest.raises(ReplicaOverloaded, match="at the batch limit 128"):
        core.admit("batch", Priority.BATCH)
    admitted += [core.admit(f"i{n}", Priority.INTERACTIVE) for n in range(128)]
    with pytest.raises(ReplicaOverloaded, match="max_waiting_requests=256"):
        core.admit("one-too-many", Priority.INTERACTIVE)
    assert (core.num_shed(Priority.INTERACTIVE), core.num_shed(Priority.BATCH), core.num_shed()) == (1, 1, 2)
    for request in admitted[:129]:
        core.finished(request)
    core.admit("batch-again", Priority.BATCH)  # 127 wait: under the batch limit again


def test_batch_requests_are_refused_from_half_the_limit():
    core = make_core(max_waiting_requests=10)
    for n in range(5):
        core.admit(f"b{n}", Priority.BATCH)
    with pytest.raises(ReplicaOverloaded) as refused:
        core.admit("b5", Priority.BATCH)
    assert refused.value.retry_after_s == 1.0
    core.admit("interactive", Priority.INTERACTIVE)


def test_a_first_token_leaves_the_queue_once_and_a_resumed_one_is_no_ttft_sample():
    clock = FakeClock(10.0)
    core = make_core(clock)
    fresh, resumed = core.admit("a", Priority.INTERACTIVE), core.admit("b", Priority.INTERACTIVE, resumed=True)
    assert core.num_resumed == 1
    clock.advance(2.0)
    assert core.oldest_wait_s() == 2.0
    for _ in range(3):
        core.first_token(fresh)
        core.first_token(resumed)
    report = core.load_report(stats_of(engine()))
    assert report.num_waiting_first_token == 0 and report.oldest_wait_s == 0.0
    assert report.ttft_p90_s == 2.0, "one TTFT sample: the resumed request's first token is none"
    core.finished(fresh)
    core.finished(fresh)  # idempotent


def test_the_load_report_takes_the_engines_counts_and_the_cores_queue():
    clock = FakeClock()
    core = make_core(clock)
    core.admit("a", Priority.INTERACTIVE)
    clock.advance(1.5)
    eng = engine()
    eng.add_request("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    eng.step()
    report = core.load_report(stats_of(eng))
    assert (report.num_waiting_first_token, report.oldest_wait_s, report.num_running) == (1, 1.5, 1)
    assert (report.num_seats, report.num_total_kv_blocks, report.num_free_kv_blocks) == (8, 64, 62)
    assert report.kv_usage == pytest.approx(2 / 64) and report.ttft_p90_s is None
    eng.abort("x")


def test_routing_reports_are_a_snapshot_then_deltas_that_a_router_applies_exactly():
    core, eng, index = make_core(), engine(), PrefixIndex()
    pool = eng.scheduler.kv.pool
    kinds = []
    for n, prompt in enumerate((list(range(1, 14)), list(range(20, 31)), list(range(1, 9)) + [99])):
        eng.add_request(f"p{n}", prompt, SamplingParams(max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        stats = eng.stats(include_block_hashes=True, block_hashes_since=core.report_base())
        report = RoutingReport.from_dict(core.routing_report(stats).to_dict())
        assert index.apply_report("r0", report, 0.0)
        assert set(index.reported_hashes("r0")) == set(pool.cached_hashes())
        kinds.append("snapshot" if report.is_snapshot else "delta")
        assert (report.num_total_kv_blocks, report.block_size, report.report_seq) == (64, 4, n + 1)
    assert kinds == ["snapshot", "delta", "delta"]


def test_a_stopped_engine_is_reported_as_such_and_the_next_report_is_a_snapshot():
    core, eng = make_core(), engine()
    first = core.routing_report(eng.stats(include_block_hashes=True, block_hashes_since=core.report_base()))
    stopped = core.routing_report(None)
    assert not stopped.engine_running and stopped.report_seq == first.report_seq + 1
    assert core.report_base() is None


def test_without_hashes_the_report_leaves_the_cache_out():
    core, eng = make_core(), engine()
    report = core.routing_report(eng.stats(), include_hashes=False)
    assert report.is_snapshot and report.num_hashes == 0 and report.num_total_kv_blocks == 64
    assert core.report_base() is None, "no delta was consumed"


def test_the_longest_request_fits_both_the_positions_and_the_whole_cache():
    assert make_core().max_request_tokens == 256
    wide = ReplicaCore("r1", SchedulerConfig(4, 1024, 8, 64, 512), FakeClock())
    assert wide.max_request_tokens == 512


def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64),
                     model_runner=FakeKVRunner(64, 4, 1024, 300), clock=FakeClock())


def stats_of(eng: LLMEngine):
    return eng.stats()
