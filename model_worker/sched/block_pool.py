"""The KV block pool: ref counts, a free queue in eviction order, and the prefix-cache map.

A block with ref_count == 0 sits in the free queue. If it holds a cached prefix (block_hash set)
it keeps its contents and its place in the hash map until it is reallocated, so a later request
with the same prefix can take it back without recomputing it. The free queue is ordered for
eviction: the head is evicted first. Freed blocks join at the tail, and a request frees its blocks
tail-first, so the last blocks of a prefix are evicted before its first ones (the first ones are
the most widely shared).

Every change to the prefix cache (a hash enters it: `cache`; a hash leaves it: reallocated,
`uncache`) bumps `cache_seq` and joins a bounded log, so that a routing report can carry what
changed since an earlier report (`changes_since`) instead of every hash the cache holds, as the
KV events of NVIDIA Dynamo and llm-d do. Logging is O(1) per change; reading a delta is
O(changes since then).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

# Prefix-cache changes the pool remembers for changes_since. A reader (the replica's routing
# report builder) asks every report period for the changes since a few reports back: 65,536
# changes cover about 10 s of a fast GPU's prefills (3,000 blocks stored and as many evicted a
# second). Each entry is a (hash, bool) tuple, about 6 MB when full.
CACHE_EVENT_CAPACITY = 65_536


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chained hash of the prefix ending with this block, once the block is full and cached.
    block_hash: int | None = None
    # The block's tokens, checked on a hash hit so a collision can never serve wrong KV.
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 cache_event_capacity: int = CACHE_EVENT_CAPACITY) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if cache_event_capacity < 0:
            raise ValueError(f"cache_event_capacity must be >= 0, got {cache_event_capacity}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Every block handed out so far, by id: ids len(blocks) .. num_blocks - 1 were never used.
        # They are made on first use: a GPU's pool has 100,000s of blocks, a simulated cluster
        # 1,000 pools, and a block that was never used needs no object.
        self.blocks: list[KVBlock] = []
        # The free queue in eviction order is: the never-used ids in order (they came first and
        # nothing joins ahead of them), then these used blocks with no reference, block_id ->
        # block, head first. O(1) removal of a hit block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # Changes to _cached so far: each hash stored or removed counts one, a reset one more.
        self.cache_seq = 0
        # The last changes, oldest first, as (block_hash, stored): the ones numbered
        # cache_seq - len + 1 .. cache_seq. Older ones fall off the left end.
        self._cache_events: deque[tuple[int, bool]] = deque(maxlen=cache_event_capacity)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: unused ones and evictable cached ones."""
        return self.num_blocks - len(self.blocks) + len(self._free)

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

    def changes_since(self, seq: int) -> tuple[list[int], list[int]] | None:
        """The prefix cache's changes after change number `seq` (a `cache_seq` read earlier), as
        (stored, removed): every hash that entered or left the cache since, by where it is now
        (stored: cached now; removed: not cached now). A hash that came and went since is in
        removed, not left out, so the pair turns the cached set as of ANY seq between `seq` and
        cache_seq into the set now: a reader that applied a later report can apply it too.
        None when the log no longer reaches back to `seq` (it overflowed, or the cache was
        reset), or when `seq` is not one this pool has reached: the reader needs a snapshot."""
        num_changes = self.cache_seq - seq
        if not 0 <= num_changes <= len(self._cache_events):
            return None
        # The last num_changes, oldest first, into one dict (all in C): a later change of a hash
        # overwrites an earlier one, so each hash ends up with where it is now.
        latest = dict(reversed(list(islice(reversed(self._cache_events), num_changes))))
        stored_hashes = [h for h, stored in latest.items() if stored]
        removed_hashes = [h for h, stored in latest.items() if not stored]
        return stored_hashes, removed_hashes

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks with {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if len(self.blocks) < self.num_blocks:
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
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
        self.cache_seq += 1  # _log_change, inline: once per block a request fills
        self._cache_events.append((block_hash, True))

    def uncache(self, block_id: int) -> None:
        """Drop one block from the prefix cache (its contents are invalid); it stays allocated."""
        if not 0 <= block_id < len(self.blocks):
            return  # never used: nothing cached
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._drop_hash(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Logged as one change that no delta can express: every
        reader of changes_since gets None (a gap) and takes a snapshot, instead of the log
        flooding with one removal per block."""
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()
        self.cache_seq += 1
        self._cache_events.clear()

    def _evict(self, block: KVBlock) -> None:
        self._drop_hash(block)
        self.num_evictions += 1

    def _drop_hash(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None and self._cached.get(block_hash) is block:
            del self._cached[block_hash]
            self._log_change(block_hash, False)
        block.block_hash = None
        block.token_ids = None

    def _log_change(self, block_hash: int, stored: bool) -> None:
        self.cache_seq += 1
        self._cache_events.append((block_hash, stored))
