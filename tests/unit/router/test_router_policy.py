"""Routing policies on fake replica snapshots, and the prefix index."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.policy import ReplicaSnapshot, RouterConfig, make_policy
from router.prefix_index import PrefixIndex


def replicas(*loads: int, free: tuple[int, ...] | None = None, total: int = 100) -> list[ReplicaSnapshot]:
    free = free or (total,) * len(loads)
    return [ReplicaSnapshot(f"r{i}", load, f, total) for i, (load, f) in enumerate(zip(loads, free))]


def prefix_aware(**config) -> object:
    return make_policy(RouterConfig(**config), random.Random(0))


def test_prefix_affinity_wins_when_loads_are_close():
    policy = prefix_aware()
    # r1 holds 8 of the 10 leading blocks and carries one more request than the others.
    choices = Counter(policy.choose(replicas(4, 5, 4), {"r1": 8}, num_blocks=10, blocks_needed=12)
                      for _ in range(200))
    assert choices == {"r1": 200}


def test_load_wins_past_the_imbalance_guard():
    policy = prefix_aware(imbalance_threshold=8)
    # r1 holds the whole prefix but has 9 more requests than r2.
    assert policy.choose(replicas(3, 10, 1), {"r1": 10}, num_blocks=10, blocks_needed=12) == "r2"
    # Within the guard, a full hit outweighs twice the load of the others.
    assert policy.choose(replicas(4, 8, 4), {"r1": 10}, num_blocks=10, blocks_needed=12) == "r1"


def test_a_replica_without_room_for_the_request_is_avoided():
    policy = prefix_aware()
    # r0 holds half the prefix but has 3 free blocks; the request needs 20 - 5 = 15 more there.
    snaps = replicas(1, 1, 1, free=(3, 50, 60))
    assert policy.choose(snaps, {"r0": 5}, num_blocks=10, blocks_needed=20) == "r2"
    # If no replica has room, the best score still wins rather than no answer.
    assert policy.choose(replicas(1, 1, free=(3, 2)), {"r0": 5}, num_blocks=10, blocks_needed=20) == "r0"


def test_ties_spread_evenly():
    policy = prefix_aware()
    counts = Counter(policy.choose(replicas(2, 2, 2)) for _ in range(3000))
    assert set(counts) == {"r0", "r1", "r2"} and all(900 <= n <= 1100 for n in counts.values()), counts


def test_baselines():
    rr = make_policy(RouterConfig(policy="round_robin"), random.Random(0))
    assert [rr.choose(replicas(9, 0, 5), {"r0": 10}, 10, 10) for _ in range(6)] == ["r0", "r1", "r2"] * 2
    pow2 = make_policy(RouterConfig(policy="pow2"), random.Random(1))
    picks = Counter(pow2.choose(replicas(0, 5, 10)) for _ in range(3000))
    # The idlest wins every pair it is in (2/3 of draws); the busiest never wins one.
    assert picks["r2"] == 0 and 1850 <= picks["r0"] <= 2150
    rand = make_policy(RouterConfig(policy="random"), random.Random(2))
    assert set(rand.choose(replicas(0, 9)) for _ in range(100)) == {"r0", "r1"}


@pytest.mark.parametrize("config", [{"policy": "least_busy"}, {"load_weight": -1}, {"imbalance_threshold": 0}])
def test_bad_config_is_refused(config):
    with pytest.raises(ValueError):
        RouterConfig(**config)


def test_index_counts_only_leading_blocks_and_sees_dispatches_at_once():
    index = PrefixIndex(dispatch_ttl_s=5.0)
    index.update("a", [1, 2, 3, 7], now_s=0.0)
    assert index.leading_hits("a", [1, 2, 3, 4, 7], now_s=1.0) == 3  # stops at the first miss
    assert index.leading_hits("b", [1, 2], now_s=1.0) == 0
    index.record_dispatch("b", [1, 2, 9], now_s=1.0)
    assert index.leading_hits("b", [1, 2, 9, 10], now_s=1.5) == 3  # before b's next report
    assert index.leading_hits("b", [1, 2, 9], now_s=6.5) == 0  # unconfirmed entries expire


def test_a_report_confirms_dispatches_and_dead_replicas_are_forgotten():
    index = PrefixIndex(dispatch_ttl_s=5.0)
    index.record_dispatch("a", [1, 2, 3], now_s=0.0)
    index.update("a", [1, 2], now_s=1.0)  # block 3 not computed yet: still pending until expiry
    assert index.leading_hits("a", [1, 2, 3], now_s=2.0) == 3
    assert index.leading_hits("a", [1, 2, 3], now_s=10.0) == 2  # 1 and 2 stay: the report holds them
    index.update("b", [1], now_s=1.0)
    index.retain(["a"])
    assert index.replica_ids == {"a"} and index.leading_hits("b", [1], now_s=2.0) == 0


def test_oracle_hit_rate_counts_leading_blocks_seen_before():
    from loadtest.benchmarks.bench_routing import oracle_hit_rate
    from loadtest.traces import BenchRequest

    shared = tuple(range(100, 148))  # 3 blocks of 16
    first = BenchRequest("a", shared + (1, 2), 4, 0.0)
    second = BenchRequest("b", shared + (3, 4), 4, 1.0)
    whole = BenchRequest("c", shared, 4, 2.0)  # fully cached, but its last token must be computed
    # Hits: a 0, b 48, c 32 (2 of its 3 blocks) over 50 + 50 + 48 prompt tokens.
    assert oracle_hit_rate([second, whole, first]) == pytest.approx((48 + 32) / 148)


def test_router_args_are_checked_before_deploying():
    from deployments.app_config import AppArgs

    assert AppArgs.parse({"router": {"policy": "pow2", "seed": 3}}).router["policy"] == "pow2"
    with pytest.raises(ValueError, match="policy"):
        AppArgs.parse({"router": {"policy": "nearest"}})
    with pytest.raises(ValueError, match="routing_stats_period_s"):
        AppArgs.parse({"routing_stats_period_s": 0})
