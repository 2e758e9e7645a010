"""Per-request block tables over the block pool, with prefix-cache lookup on admission."""

from __future__ import annotations

from model_worker.sched.block_pool import BlockPool, KVBlock
from model_worker.sched.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # The same tables as plain ids, kept in step with _blocks so the scheduler can hand the
        # runner a block table without rebuilding it each step.
        self._block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Leading blocks of the request already in the cache. The last token is never a hit:
        its logits are needed to sample, so it is always computed. A request that wants its
        prompt's logprobs hits nothing: a cached block has no logits."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = request.token_slice(index * self.block_size, (index + 1) * self.block_size)
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None, cache_blocks: bool = True) -> bool:
        """Give the request blocks for num_computed_tokens + num_new_tokens tokens (after adding
        computed_blocks, prefix hits taken at admission). False, changing nothing, if the pool
        cannot supply them. cache_blocks=False keeps the new tokens' blocks out of the prefix
        cache (a slot that is written again and again)."""
        owned = self._blocks.get(request.request_id)
        if owned is not None and not computed_blocks:
            # A running request (every decode and every later chunk): new blocks only when it
            # crosses a block boundary, and cache work only when a block has filled up.
            total_tokens = request.num_computed_tokens + num_new_tokens
            num_new_blocks = -(-total_tokens // self.block_size) - len(owned)
            if num_new_blocks > 0:
                if num_new_blocks > self.pool.num_free_blocks:
                    return False
                self._append_new_blocks(request.request_id, owned, num_new_blocks)
            if cache_blocks:
                self._cache_full_blocks(request, total_tokens)
            return True
        computed_blocks = computed_blocks or []
        owned = owned if owned is not None else []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total_tokens) - len(owned) - len(computed_blocks))
        # Idle cached hits sit in the free queue: taking them uses up free blocks too.
        num_idle_hits = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_new_blocks + num_idle_hits > self.pool.num_free_blocks:
            return False
        if request.request_id not in self._blocks:
            self._blocks[request.request_id] = owned
            self._block_ids[request.request_id] = []
            self._num_cached[request.request_id] = 0
        ids = self._block_ids[request.request_id]
        if computed_blocks:
            self.pool.touch(computed_blocks)
            owned.extend(computed_blocks)
            ids.extend(block.block_id for block in computed_blocks)
            self._num_cached[request.request_id] = len(owned)
        if num_new_blocks:
            self._append_new_blocks(request.request_id, owned, num_new_blocks)
        if cache_blocks:
            self._cache_full_blocks(request, total_tokens)
        return True

    def _append_new_blocks(self, request_id: str, owned: list[KVBlock], num_blocks: int) -> None:
        new_blocks = self.pool.allocate(num_blocks)
        owned.extend(new_blocks)
        self._block_ids[request_id].extend(block.block_id for block in new_blocks)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are written. Their tokens are
        known (scheduled tokens are never placeholders), so their hashes are too."""
        start = self._num_cached[request.request_id]
        # Most calls (every decode step) fill no block: they stop here.
        if not self.enable_caching or num_tokens // self.block_size <= start:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        owned = self._blocks[request.request_id]
        for index in range(start, num_full):
            tokens = request.token_slice(index * self.block_size, (index + 1) * self.block_size)
            self.pool.cache(owned[index], request.block_hashes[index], tokens)
        self._num_cached[request.request_id] = max(start, num_full)

    def uncache(self, block_ids: list[int]) -> None:
        """These blocks' contents are not what their hashes say (a failed step wrote them): take
        them out of the prefix cache, so that no later request can hit them."""
        for block_id in block_ids:
            self.pool.uncache(block_id)

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_ids[request_id]

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """request id -> its block table (block_ids of every request; read it, do not change it)."""
        return self._block_ids

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live requests (idle cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks
