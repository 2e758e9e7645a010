"""The KV block pool: ref counts, a free queue in eviction order, and the prefix-cache map.

A block with ref_count == 0 sits in the free queue. If it holds a cached prefix (block_hash set)
it keeps its contents and its place in the hash map until it is reallocated, so a later request
with the same prefix can take it back without recomputing it. The free queue is ordered for
eviction: the head is evicted first. Freed blocks join at the tail, and a request frees its blocks
tail-first, so the last blocks of a prefix are evicted before its first ones (the first ones are
the most widely shared).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chained hash of the prefix ending with this block, once the block is full and cached.
    block_hash: int | None = None
    # The block's tokens, checked on a hash hit so a collision can never serve wrong KV.
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # block_id -> block, in eviction order (head first). O(1) removal of a hit block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: unused ones and evictable cached ones."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (first freed, first evicted)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full block under its chained hash. The first block with a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def uncache(self, block_id: int) -> None:
        """Drop one block from the prefix cache (its contents are invalid); it stays allocated."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1
