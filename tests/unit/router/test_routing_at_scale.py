"""Routing that does not visit every replica: PrefixIndex.hits against leading_hits per replica,
the policies over a ReplicaTable against a plain loop over snapshots, and the block
pool that makes its blocks on first use."""

from __future__ import annotations

import random

import pytest

from contracts import RoutingReport
from router.policy import ReplicaSnapshot, ReplicaTable, RouterConfig, make_policy
from router.prefix_index import PrefixIndex


def reference_prefix_aware(config: RouterConfig, rng: random.Random, replicas, hits, num_blocks, blocks_needed):
    """PrefixAware._choose as a plain loop over snapshots: the reference its ReplicaTable form must
    agree with."""
    loads = [r.load for r in replicas]
    if max(loads) - min(loads) > config.imbalance_threshold:
        low = min(loads)
        return rng.choice([r.replica_id for r in replicas if r.load == low])
    roomy = [r for r in replicas
             if r.num_free_kv_blocks >= blocks_needed - hits.get(r.replica_id, 0) or not r.num_total_kv_blocks]
    max_load = max(max(loads), 1)
    best, best_score = [], float("-inf")
    for r in roomy or replicas:
        hit_fraction = hits.get(r.replica_id, 0) / num_blocks if num_blocks else 0.0
        kv_pressure = 1.0 - r.num_free_kv_blocks / r.num_total_kv_blocks if r.num_total_kv_blocks else 0.0
        score = (config.prefix_weight * hit_fraction - config.load_weight * r.load / max_load
                 - config.kv_weight * kv_pressure)
        if score > best_score + 1e-12:
            best, best_score = [r.replica_id], score
        elif abs(score - best_score) <= 1e-12:
            best.append(r.replica_id)
    return rng.choice(best)


def reference_pow2(rng: random.Random, replicas):
    pair = rng.sample(list(replicas), min(2, len(replicas)))
    low = min(r.load for r in pair)
    return rng.choice([r.replica_id for r in pair if r.load == low])


def random_case(rng: random.Random):
    n = rng.choice([1, 2, 3, 7, 64, 300])
    snapshots = [ReplicaSnapshot(f"r{i}", rng.randrange(12), rng.randrange(0, 50), rng.choice([0, 40, 50]))
                 for i in range(n)]
    num_blocks = rng.randrange(0, 12)
    hits = {f"r{i}": rng.randrange(0, num_blocks + 1) for i in rng.sample(range(n), min(n, 5))} if num_blocks else {}
    hits["not-a-candidate"] = num_blocks
    return snapshots, hits, num_blocks, rng.randrange(0, 40)


def test_prefix_aware_over_a_table_chooses_as_the_loop_over_snapshots():
    case_rng = random.Random(1)
    for seed in range(400):
        snapshots, hits, num_blocks, needed = random_case(case_rng)
        config = RouterConfig(imbalance_threshold=case_rng.choice([1, 8, 100]))
        policy = make_policy(config, random.Random(seed))
        reference_rng = random.Random(seed)
        for _ in range(3):
            expected = reference_prefix_aware(config, reference_rng, snapshots, hits, num_blocks, needed)
            assert policy.choose(snapshots, hits, num_blocks, needed) == expected
            # A table kept by the caller gives the same choice as snapshots.
            expected = reference_prefix_aware(config, reference_rng, snapshots, hits, num_blocks, needed)
            assert policy.choose(ReplicaTable.from_snapshots(snapshots), hits, num_blocks, needed) == expected


def test_pow2_round_robin_and_random_over_a_table_choose_as_before():
    case_rng = random.Random(2)
    for seed in range(200):
        snapshots, _, _, _ = random_case(case_rng)
        pow2, reference_rng = make_policy(RouterConfig(policy="pow2"), random.Random(seed)), random.Random(seed)
        assert [pow2.choose(snapshots) for _ in range(5)] == [reference_pow2(reference_rng, snapshots) for _ in range(5)]
        rand, reference_rng = make_policy(RouterConfig(policy="random"), random.Random(seed)), random.Random(seed)
        assert rand.choose(snapshots) == reference_rng.choice(snapshots).replica_id
    rr = make_policy(RouterConfig(policy="round_robin"))
    table = ReplicaTable(["b", "c", "a"])
    assert [rr.choose(table) for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="no replica"):
        rr.choose([])


def test_a_table_updated_in_place_is_read_at_the_next_decision():
    policy = make_policy(RouterConfig(policy="prefix_aware"), random.Random(0))
    table = ReplicaTable(["r0", "r1"], load=[0, 0], free=[100, 100], total=[100, 100])
    assert policy.choose(table, {"r0": 4}, 4, 8) == "r0"
    table.free[0] = 0  # r0 has no room for the request now
    assert policy.choose(table, {"r0": 4}, 4, 8) == "r1"


def report(replica_id: str, seq: int, stored=(), removed=(), base: int | None = None, snapshot=None) -> RoutingReport:
    if snapshot is not None:
        return RoutingReport(replica_id, seq, cache_seq=seq, cached_block_hashes=list(snapshot))
    return RoutingReport(replica_id, seq, cache_seq=seq, delta_base_seq=base if base is not None else seq - 1,
                         stored_block_hashes=list(stored), removed_block_hashes=list(removed))


def test_hits_for_all_replicas_equal_leading_hits_of_each_under_random_changes():
    rng = random.Random(3)
    chains = [[rng.getrandbits(62) for _ in range(12)] for _ in range(6)]
    universe = [h for chain in chains for h in chain]
    replica_ids = [f"r{i}" for i in range(8)]
    index = PrefixIndex(dispatch_ttl_s=2.0)
    held = {rid: set() for rid in replica_ids}
    seqs = dict.fromkeys(replica_ids, 0)
    now = 0.0
    for step in range(3000):
        now += rng.random() * 0.3
        rid = rng.choice(replica_ids)
        action = rng.random()
        if action < 0.35:  # a delta: some stored, some removed
            stored = set(rng.sample(universe, 4))
            removed = set(rng.sample(sorted(held[rid]), min(3, len(held[rid])))) - stored
            held[rid] = (held[rid] - removed) | stored
            seqs[rid] += 1
            index.apply_report(rid, report(rid, seqs[rid], stored, removed), now)
        elif action < 0.45:  # a snapshot
            held[rid] = set(rng.sample(universe, rng.randrange(0, 30)))
            seqs[rid] += 1
            index.apply_report(rid, report(rid, seqs[rid], snapshot=held[rid]), now)
        elif action < 0.5:
            index.update(rid, rng.sample(universe, 10), now)
        elif action < 0.8:
            chain = rng.choice(chains)
            index.record_dispatch(rid, chain[:rng.randrange(1, 13)], now)
        elif action < 0.82:
            index.retain([r for r in replica_ids if r != rid])
        chain = rng.choice(chains)[:rng.randrange(0, 13)]
        expected = {r: n for r in replica_ids if (n := index.leading_hits(r, chain, now))}
        assert index.hits(chain, now) == expected, step
