from __future__ import annotations

import os
import subprocess
import sys

import pytest

from model_worker.block_pool import BlockPool
from model_worker.hashing import ROOT_HASH, hash_block_tokens, hash_prompt_blocks


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
    code = "from model_worker.hashing import hash_prompt_blocks; print(hash_prompt_blocks(list(range(64)), 16, 'k'))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(hash_prompt_blocks(list(range(64)), 16, "k"))

