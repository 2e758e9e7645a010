"""PrefixIndex: which replica holds which KV blocks, by the engine's own block hashes. Pure.

Two sources, because reports lag: what each replica last reported holding (its prefix cache's
hash set, through `record_routing_stats`), and what this router sent it since. A dispatch is
recorded at once, so a burst of requests sharing a prefix follows the first one to the same
replica before that replica's next report; a dispatched entry expires after `dispatch_ttl_s`
unless a report confirms it (the replica may evict or never compute it). A replica that leaves
the candidate set is forgotten with all its entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, dispatch_ttl_s: float = 10.0) -> None:
        if not dispatch_ttl_s > 0:
            raise ValueError(f"dispatch_ttl_s must be > 0, got {dispatch_ttl_s!r}")
        self.dispatch_ttl_s = dispatch_ttl_s
        self._reported: dict[str, set[int]] = {}
        # replica -> block hash -> time (s) after which the optimistic entry is dropped.
        self._dispatched: dict[str, dict[int, float]] = {}

    def update(self, replica_id: str, cached_hashes: Iterable[int], now_s: float) -> None:
        """A replica's report: the hashes its prefix cache holds now."""
        reported = set(cached_hashes)
        self._reported[replica_id] = reported
        pending = self._dispatched.get(replica_id)
        if pending:
            self._dispatched[replica_id] = {h: t for h, t in pending.items() if t > now_s and h not in reported}

    def record_dispatch(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        pending = self._dispatched.setdefault(replica_id, {})
        expires_s = now_s + self.dispatch_ttl_s
        for h in block_hashes:
            pending[h] = expires_s

    def leading_hits(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> int:
        """How many leading blocks of the chain the replica holds (reported or recently sent)."""
        reported = self._reported.get(replica_id, ())
        pending = self._dispatched.get(replica_id, {})
        count = 0
        for h in block_hashes:
            if h in reported or pending.get(h, 0.0) > now_s:
                count += 1
            else:
                break
        return count

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in `replica_ids` (dead or scaled down)."""
        keep = set(replica_ids)
        for table in (self._reported, self._dispatched):
            for replica_id in [r for r in table if r not in keep]:
                del table[replica_id]

    @property
    def replica_ids(self) -> set[str]:
        return set(self._reported) | set(self._dispatched)
