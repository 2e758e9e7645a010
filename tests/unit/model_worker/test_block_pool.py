from __future__ import annotations

import os
import subprocess
import sys

import pytest

from model_worker.sched.block_pool import BlockPool
from model_worker.sched.hashing import ROOT_HASH, hash_block_tokens, hash_prompt_blocks


def test_lru_order_evicts_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache(block, 100 + i, [i])
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]
    assert not pool.contains(102) and not pool.contains(100), "reallocated blocks leave the cache"
    assert pool.contains(103) and pool.contains(101)
    assert pool.num_evictions == 2


def test_ref_counts_keep_shared_block_out_of_free_queue():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, 7, [1, 2])
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert pool.num_free_blocks == 1, "still referenced once"
    pool.free([block])
    assert pool.num_free_blocks == 2
    assert pool.lookup(7, [1, 2]) is block, "an idle cached block keeps its contents"
    pool.touch([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_hit_checks_tokens_so_a_collision_never_serves_wrong_kv():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, 42, [1, 2, 3])
    assert pool.lookup(42, [1, 2, 3]) is block
    assert pool.lookup(42, [9, 9, 9]) is None


def test_allocating_more_than_free_raises():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_hashes_are_chained_and_namespaced():
    a = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(a) == 2, "the trailing partial block has no hash"
    assert a[0] == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])
    b = hash_prompt_blocks([0, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert b[1] != a[1], "same block tokens after a different prefix hash differently"
    assert hash_prompt_blocks([1, 2, 3, 4], 4, extra_key="lora-a") != hash_prompt_blocks([1, 2, 3, 4], 4)
    assert len(pool_counts := {x for x in a}) == 2 and pool_counts


def test_hashes_are_stable_across_processes():
    code = "from model_worker.sched.hashing import hash_prompt_blocks; print(hash_prompt_blocks(list(range(64)), 16, 'k'))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(hash_prompt_blocks(list(range(64)), 16, "k"))



# ---- the prefix cache's change log (routing reports send what changed: router/report_builder.py)

def cached_pool(num_blocks: int = 4, **kwargs) -> tuple[BlockPool, list]:
    """A pool whose blocks each hold a cached hash 100 + i, all freed (idle, evictable) in order."""
    pool = BlockPool(num_blocks, **kwargs)
    blocks = pool.allocate(num_blocks)
    for i, block in enumerate(blocks):
        pool.cache(block, 100 + i, [i])
    pool.free(blocks)
    return pool, blocks


def as_sets(changes) -> tuple[set[int], set[int]]:
    stored, removed = changes
    return set(stored), set(removed)


def test_every_hash_entering_the_cache_is_a_change():
    pool, _ = cached_pool()
    assert pool.cache_seq == 4
    assert as_sets(pool.changes_since(0)) == ({100, 101, 102, 103}, set())
    assert as_sets(pool.changes_since(2)) == ({102, 103}, set())
    assert pool.changes_since(4) == ([], [])
    (block,) = pool.allocate(1)  # evicts 100 (head of the free queue)
    pool.cache(block, 101, [9])  # 101 is cached in another block: the first keeps it, no change
    assert pool.cache_seq == 5 and as_sets(pool.changes_since(4)) == (set(), {100})


def test_a_hash_leaves_on_reallocation_and_on_uncache():
    pool, blocks = cached_pool()
    pool.allocate(2)  # reallocates the blocks of 100 and 101
    assert as_sets(pool.changes_since(4)) == (set(), {100, 101})
    pool.touch([blocks[2]])
    pool.uncache(blocks[2].block_id)  # a failed step wrote it
    pool.uncache(blocks[2].block_id)  # twice: nothing more leaves
    assert pool.cache_seq == 7 and as_sets(pool.changes_since(4)) == (set(), {100, 101, 102})
    assert set(pool.cached_hashes()) == {103}


def test_changes_are_netted_by_where_each_hash_is_now():
    pool, _ = cached_pool(2)
    base = pool.cache_seq
    (block,) = pool.allocate(1)  # 100 leaves ...
    pool.cache(block, 100, [0])  # ... and comes back: stored, not removed
    pool.cache(pool.allocate(1)[0], 555, [5])  # 101 leaves, 555 enters ...
    pool.uncache(next(b.block_id for b in pool.blocks if b.block_hash == 555))  # ... and 555 leaves
    stored, removed = as_sets(pool.changes_since(base))
    # 555 came and went: listed as removed, so that a reader who saw it come sees it go too.
    assert stored == {100} and removed == {101, 555}
    # Applied to the cached set as of ANY seq from the base on, the changes give the set now.
    truth = set(pool.cached_hashes())
    assert ({100, 101} - removed) | stored == truth
    assert ({100, 555} - removed) | stored == truth  # the set just before 555 left


def test_a_reader_further_back_than_the_log_gets_a_gap():
    pool, _ = cached_pool(4, cache_event_capacity=3)
    assert pool.cache_seq == 4
    assert pool.changes_since(0) is None, "the first change fell off the log"
    assert as_sets(pool.changes_since(1)) == ({101, 102, 103}, set())
    assert pool.changes_since(5) is None and pool.changes_since(-1) is None, "a seq the pool never reached"
    pool.reset_prefix_cache()
    assert pool.cache_seq == 5 and pool.num_cached_blocks == 0
    assert pool.changes_since(4) is None, "a reset is a gap: the reader takes a snapshot"
    assert pool.changes_since(5) == ([], [])
    with pytest.raises(ValueError):
        BlockPool(4, cache_event_capacity=-1)


def test_cache_seq_only_grows_and_the_log_replays_to_the_real_set():
    import random

    rng = random.Random(3)
    pool = BlockPool(8, cache_event_capacity=1_000_000)
    snapshots = {0: set()}
    held: list = []
    for _ in range(2000):
        before = pool.cache_seq
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            held.extend(pool.allocate(1))
        elif op < 0.7 and held:
            pool.cache(rng.choice(held), rng.randrange(30), [0])
        elif op < 0.95 and held:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif held:
            pool.uncache(rng.choice(held).block_id)
        assert pool.cache_seq >= before
        snapshots[pool.cache_seq] = set(pool.cached_hashes())
    now = set(pool.cached_hashes())
    for seq, then in snapshots.items():
        stored, removed = as_sets(pool.changes_since(seq))
        assert (then - removed) | stored == now, seq


def test_blocks_are_made_on_first_use_in_the_order_an_eager_pool_hands_them_out():
    pool = BlockPool(1_000_000)
    assert pool.blocks == [] and pool.num_free_blocks == 1_000_000
    first = pool.allocate(3)
    assert [b.block_id for b in first] == [0, 1, 2] and len(pool.blocks) == 3
    pool.free([first[1]])
    # Never-used blocks come before a freed one (they were ahead of it in the free queue).
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    assert pool.num_free_blocks == 1_000_000 - 4
    pool.uncache(999_999)  # a block never used holds nothing: a no-op
    small = BlockPool(3)
    blocks = small.allocate(3)
    small.free(reversed(blocks))
    assert [b.block_id for b in small.allocate(3)] == [2, 1, 0]
