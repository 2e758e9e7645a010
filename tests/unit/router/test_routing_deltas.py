"""Routing reports as prefix-cache deltas: the replica's builder, the router's PrefixIndex, and the
two together over a real BlockPool, reports lost on the way included."""

from __future__ import annotations

import json
import random

import pytest

from contracts import RoutingReport
from model_worker.sched.block_pool import BlockPool
from router.prefix_index import PrefixIndex
from router.report_builder import RoutingReportBuilder


class FakeCache:
    """A cache state the builder reads: a seq, a change log that may have a gap, a snapshot."""

    def __init__(self) -> None:
        self.cache_seq = 0
        self.hashes: set[int] = set()
        self.log: list[tuple[int, bool]] = []  # change number i + 1 is log[i]
        self.forgotten_before = 0  # changes_since(seq) is a gap for seq < this

    def store(self, *hashes: int) -> None:
        for h in hashes:
            self.hashes.add(h)
            self.log.append((h, True))
            self.cache_seq += 1

    def remove(self, *hashes: int) -> None:
        for h in hashes:
            self.hashes.discard(h)
            self.log.append((h, False))
            self.cache_seq += 1

    def changes_since(self, seq: int):
        if seq < self.forgotten_before:
            return None
        latest = dict(self.log[seq:])
        return [h for h, s in latest.items() if s], [h for h, s in latest.items() if not s]

    def build(self, builder: RoutingReportBuilder) -> RoutingReport:
        return builder.build("r", cache_seq=self.cache_seq, changes_since=self.changes_since,
                             snapshot=lambda: sorted(self.hashes), num_free_kv_blocks=3, block_size=16)


# ---- the builder ----------------------------------------------------------------------------------

def test_the_first_report_is_full_then_deltas_then_a_full_one_every_n():
    cache, builder = FakeCache(), RoutingReportBuilder(full_report_every=4, history=1)
    kinds = []
    for i in range(9):
        cache.store(100 + i)
        report = cache.build(builder)
        kinds.append("full" if report.is_snapshot else "delta")
        assert report.report_seq == i + 1 and report.cache_seq == cache.cache_seq and report.num_free_kv_blocks == 3
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta", "full"]
    assert (builder.num_full_reports, builder.num_delta_reports, builder.num_gaps) == (3, 6, 0)


def test_a_delta_counts_from_the_report_history_reports_back():
    cache, builder = FakeCache(), RoutingReportBuilder(full_report_every=100, history=3)
    seqs = []
    for i in range(6):
        cache.store(100 + i)
        report = cache.build(builder)
        if i == 0:
            assert report.is_snapshot and report.cached_block_hashes == (100,)
        else:  # the base is the cache_seq of the report 3 back (or the first, while fewer came)
            assert report.delta_base_seq == seqs[max(0, i - 3)]
            assert set(report.stored_block_hashes) == {100 + j for j in range(max(1, i - 2), i + 1)}
        seqs.append(report.cache_seq)
    assert builder.next_base() == seqs[3]


def test_a_gap_in_the_source_brings_a_full_report_and_deltas_count_from_it():
    cache, builder = FakeCache(), RoutingReportBuilder(full_report_every=100, history=2)
    cache.store(1)
    cache.build(builder)
    cache.store(2)
    cache.build(builder)
    cache.remove(1)
    cache.store(3)
    cache.forgotten_before = cache.cache_seq  # the log overflowed (or the cache was reset)
    gap = cache.build(builder)
    assert gap.is_snapshot and set(gap.cached_block_hashes) == {2, 3} and builder.num_gaps == 1
    cache.store(4)
    after = cache.build(builder)
    assert after.delta_base_seq == gap.cache_seq and after.stored_block_hashes == (4,)
    assert builder.num_gaps == 1, "the base after the snapshot is in the log: no second gap"


def test_a_stopped_engine_reports_no_cache_and_the_next_report_is_full():
    cache, builder = FakeCache(), RoutingReportBuilder()
    cache.store(1)
    cache.build(builder)
    stopped = builder.stopped("r")
    assert not stopped.engine_running and stopped.is_snapshot and stopped.report_seq == 2
    assert cache.build(builder).is_snapshot
    with pytest.raises(ValueError):
        RoutingReportBuilder(full_report_every=0)
    with pytest.raises(ValueError):
        RoutingReportBuilder(history=0)


# ---- the index ------------------------------------------------------------------------------------

def delta(cache_seq: int, base: int, stored=(), removed=(), report_seq: int = 2) -> RoutingReport:
    return RoutingReport("a", report_seq, cache_seq=cache_seq, delta_base_seq=base, stored_block_hashes=tuple(stored),
                         removed_block_hashes=tuple(removed))


def test_a_delta_gives_the_set_of_the_snapshot_it_stands_for_and_a_replay_is_harmless():
    index = PrefixIndex()
    assert index.apply_report("a", RoutingReport("a", 1, cached_block_hashes=(1, 2, 3), cache_seq=10), 0.0)
    change = delta(13, 10, stored=[4], removed=[2, 9])
    assert index.apply_report("a", change, 0.0)
    assert set(index.reported_hashes("a")) == {1, 3, 4}
    assert index.leading_hits("a", [1, 3, 4, 2], 0.0) == 3
    assert index.apply_report("a", change, 0.0), "the same delta again"
    assert set(index.reported_hashes("a")) == {1, 3, 4}
    assert index.apply_report("a", delta(12, 10, stored=[4]), 0.0), "an older one, after a newer"
    assert set(index.reported_hashes("a")) == {1, 3, 4} and index.is_exact("a")
    assert (index.num_full_reports, index.num_delta_reports, index.num_stale_reports, index.num_gap_reports) == (1, 2, 1, 0)


def test_a_delta_past_what_the_router_holds_is_a_gap_healed_by_the_next_snapshot():
    index = PrefixIndex(dispatch_ttl_s=5.0)
    index.apply_report("a", RoutingReport("a", 1, cached_block_hashes=(1, 2, 3), cache_seq=10), 0.0)
    # Changes 11..20 never arrived (2 left then); this delta counts from change 20.
    assert not index.apply_report("a", delta(25, 20, stored=[7], removed=[3]), 0.0)
    assert not index.is_exact("a") and index.num_gap_reports == 1
    # Kept, with the delta applied: what the delta names is right, 2 is stale until the snapshot.
    assert set(index.reported_hashes("a")) == {1, 2, 7}
    assert not index.apply_report("a", delta(30, 25, stored=[8]), 0.0), "exact deltas do not heal a gap"
    assert index.apply_report("a", RoutingReport("a", 4, cached_block_hashes=(1, 7, 8), cache_seq=31), 0.0)
    assert index.is_exact("a") and set(index.reported_hashes("a")) == {1, 7, 8}
    # A router that never had a snapshot of the replica (new, or fed by update()) is in a gap too.
    fresh = PrefixIndex()
    assert not fresh.apply_report("b", delta(5, 3, stored=[4]), 0.0) and set(fresh.reported_hashes("b")) == {4}
    fresh.update("c", [1], 0.0)
    assert not fresh.apply_report("c", delta(5, 3, stored=[4]), 0.0)
    fresh.retain(["c"])
    assert fresh.replica_ids == {"c"} and not fresh.apply_report("c", delta(6, 5), 0.0)


def test_a_delta_confirms_dispatched_entries():
    index = PrefixIndex(dispatch_ttl_s=5.0)
    index.apply_report("a", RoutingReport("a", 1, cache_seq=0), 0.0)
    index.record_dispatch("a", [1, 2, 3], now_s=0.0)
    index.apply_report("a", delta(2, 0, stored=[1, 2]), 1.0)
    assert index.leading_hits("a", [1, 2, 3], now_s=10.0) == 2, "1 and 2 reported; 3 expired unconfirmed"


# ---- the two together over a real BlockPool -------------------------------------------------------

def random_cache_work(pool: BlockPool, held: list, rng: random.Random, steps: int) -> None:
    """Allocations (evicting idle cached blocks), caching, frees and failed-step uncaches, with
    hashes drawn from a small range so that the same hash comes and goes."""
    for _ in range(steps):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            held.extend(pool.allocate(rng.randint(1, min(3, pool.num_free_blocks))))
        elif op < 0.7 and held:
            pool.cache(rng.choice(held), rng.randrange(200), [0])
        elif op < 0.97 and held:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif held:
            pool.uncache(rng.choice(held).block_id)


def wire(report: RoutingReport) -> RoutingReport:
    """What a router gets: the dict through JSON-able types and back."""
    return RoutingReport.from_dict(json.loads(json.dumps(report.to_dict())))


@pytest.mark.parametrize("seed", range(5))
def test_routers_fed_deltas_hold_exactly_the_replicas_cached_set(seed):
    """One router sees every report, one misses up to history - 1 in a row (Serve keeps only the
    latest): after the first snapshot both apply only deltas and always hold the pool's real set."""
    rng = random.Random(seed)
    pool, held = BlockPool(48, cache_event_capacity=10_000), []
    builder = RoutingReportBuilder(full_report_every=10_000, history=3)
    every, lossy = PrefixIndex(), PrefixIndex()
    missed_in_a_row = 0
    for _ in range(300):
        random_cache_work(pool, held, rng, rng.randint(0, 12))
        report = wire(builder.build("r", cache_seq=pool.cache_seq, changes_since=pool.changes_since,
                                    snapshot=pool.cached_hashes))
        truth = set(pool.cached_hashes())
        assert every.apply_report("r", report, 0.0) and set(every.reported_hashes("r")) == truth
        if report.report_seq > 1 and missed_in_a_row < builder.history - 1 and rng.random() < 0.5:
            missed_in_a_row += 1
            continue
        missed_in_a_row = 0
        assert lossy.apply_report("r", report, 0.0) and set(lossy.reported_hashes("r")) == truth
    assert builder.num_full_reports == 1 and every.num_full_reports == 1 and lossy.num_full_reports == 1
    assert every.num_gap_reports == lossy.num_gap_reports == 0 and every.num_delta_reports == 299


def test_a_router_further_behind_or_a_log_overflow_recovers_at_the_next_snapshot():
    rng = random.Random(7)
    pool, held = BlockPool(32, cache_event_capacity=60), []
    builder = RoutingReportBuilder(full_report_every=8, history=2)
    index = PrefixIndex()
    inexact_since = None
    for i in range(120):
        random_cache_work(pool, held, rng, rng.choice([2, 2, 2, 120]))  # now and then more than the log holds
        report = wire(builder.build("r", cache_seq=pool.cache_seq, changes_since=pool.changes_since,
                                    snapshot=pool.cached_hashes))
        if i % 11 in (3, 4, 5):  # three reports lost in a row: more than a delta covers
            continue
        exact = index.apply_report("r", report, 0.0)
        assert exact == index.is_exact("r")
        if exact:
            assert set(index.reported_hashes("r")) == set(pool.cached_hashes())
            inexact_since = None
        elif inexact_since is None:
            inexact_since = i
        # Inexact at most until the next full report that arrives: one every 8, lost ones 3 in a row.
        assert inexact_since is None or i - inexact_since < 2 * 8 + 3
    assert builder.num_gaps > 0 and index.num_gap_reports > 0


def test_report_sizes_a_delta_is_a_small_fraction_of_the_snapshot():
    from loadtest.benchmarks.bench_report_sizes import measure

    row = measure(cached_blocks=5_000, tokens_per_s=300, seconds=5)
    assert row["full_bytes"] > 100_000 and row["delta_bytes"] < row["full_bytes"] / 20, row
