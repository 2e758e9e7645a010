"""PrefixIndex: which replica holds which KV blocks, by the engine's own block hashes. Pure.

Two sources, because reports lag: what each replica last reported holding (its prefix cache's
hash set, through `record_routing_stats`), and what this router sent it since. A dispatch is
recorded at once, so a burst of requests sharing a prefix follows the first one to the same
replica before that replica's next report; a dispatched entry expires after `dispatch_ttl_s`
unless a report confirms it (the replica may evict or never compute it). A replica that leaves
the candidate set is forgotten with all its entries.

Reports come as full snapshots or as deltas (router/report_builder.py): `apply_report` keeps,
per replica, the cache_seq its set stands at. A delta applies exactly when its base is at or
before that; otherwise (this router missed more reports than the delta covers, or it has no
snapshot of the replica yet) it is a gap: the delta is applied anyway and the replica's set is
marked inexact until the next snapshot. Applying it is never worse than not: every hash the
delta names is then where the replica has it; only changes between the set's seq and the delta's
base are missing. The set is kept rather than dropped because most of it is still right (shared
prefixes stay cached longest) and the next snapshot comes within a bounded number of periods.

Every entry is also indexed the other way, block hash -> the replicas holding it, so `hits`
answers for all replicas at once in time that grows with the chain and its holders, not with
the replica count: at 1,000 replicas a decision must not visit every replica's set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from contracts import RoutingReport


class PrefixIndex:
    def __init__(self, dispatch_ttl_s: float = 10.0) -> None:
        if not dispatch_ttl_s > 0:
            raise ValueError(f"dispatch_ttl_s must be > 0, got {dispatch_ttl_s!r}")
        self.dispatch_ttl_s = dispatch_ttl_s
        self._reported: dict[str, set[int]] = {}
        # replica -> the cache_seq its reported set stands at (absent: set by update(), no seq).
        self._cache_seq: dict[str, int] = {}
        # Replicas whose reported set missed some changes (a gap), until their next snapshot.
        self._inexact: set[str] = set()
        # replica -> block hash -> time (s) after which the optimistic entry is dropped.
        self._dispatched: dict[str, dict[int, float]] = {}
        # The same entries by hash: hash -> the replica reporting it (one, the common case, as a
        # str) or the set of them; hash -> replica -> expiry for the dispatched ones.
        self._holders: dict[int, str | set[str]] = {}
        self._pending: dict[int, dict[str, float]] = {}
        # Reports applied, by kind: snapshots, deltas applied exactly, deltas that found a gap
        # (applied as well as they could be), and reports older than the set (ignored).
        self.num_full_reports = 0
        self.num_delta_reports = 0
        self.num_gap_reports = 0
        self.num_stale_reports = 0

    def update(self, replica_id: str, cached_hashes: Iterable[int], now_s: float) -> None:
        """A replica's report: the hashes its prefix cache holds now (no cache_seq: a delta that
        follows is a gap)."""
        self._set_reported(replica_id, set(cached_hashes), now_s)
        self._cache_seq.pop(replica_id, None)
        self._inexact.discard(replica_id)

    def apply_report(self, replica_id: str, report: RoutingReport, now_s: float) -> bool:
        """Fold a replica's report in. True when the replica's set is now exact (as of this report
        or a later one); False after a gap, until a snapshot comes. A delta replayed, or older
        than the set, changes nothing; a snapshot always replaces the set (it is exact as it is)."""
        if report.is_snapshot:
            self._set_reported(replica_id, set(report.cached_block_hashes), now_s)
            self._cache_seq[replica_id] = report.cache_seq
            self._inexact.discard(replica_id)
            self.num_full_reports += 1
            return True
        seq = self._cache_seq.get(replica_id)
        if seq is not None and report.cache_seq < seq:
            self.num_stale_reports += 1
            return replica_id not in self._inexact
        if seq is None or report.delta_base_seq > seq:
            self._inexact.add(replica_id)
            self.num_gap_reports += 1
        else:
            self.num_delta_reports += 1
        reported = self._reported.setdefault(replica_id, set())
        for h in report.removed_block_hashes:
            if h in reported:
                reported.discard(h)
                self._drop_holder(h, replica_id)
        for h in report.stored_block_hashes:
            if h not in reported:
                reported.add(h)
                self._add_holder(h, replica_id)
        self._cache_seq[replica_id] = report.cache_seq
        self._prune_dispatched(replica_id, reported, now_s)
        return replica_id not in self._inexact

    def _set_reported(self, replica_id: str, reported: set[int], now_s: float) -> None:
        old = self._reported.get(replica_id, set())
        for h in old - reported:
            self._drop_holder(h, replica_id)
        for h in reported - old:
            self._add_holder(h, replica_id)
        self._reported[replica_id] = reported
        self._prune_dispatched(replica_id, reported, now_s)

    def _add_holder(self, block_hash: int, replica_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            self._holders[block_hash] = replica_id
        elif isinstance(holders, str):
            if holders != replica_id:
                self._holders[block_hash] = {holders, replica_id}
        else:
            holders.add(replica_id)

    def _drop_holder(self, block_hash: int, replica_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            return
        if isinstance(holders, str):
            if holders == replica_id:
                del self._holders[block_hash]
            return
        holders.discard(replica_id)
        if len(holders) == 1:
            self._holders[block_hash] = next(iter(holders))

    def _prune_dispatched(self, replica_id: str, reported: Set[int], now_s: float) -> None:
        """Drop dispatched entries that expired or that the report now confirms."""
        pending = self._dispatched.get(replica_id)
        if pending:
            keep = {}
            for h, t in pending.items():
                if t > now_s and h not in reported:
                    keep[h] = t
                else:
                    self._drop_pending(h, replica_id)
            self._dispatched[replica_id] = keep

    def _drop_pending(self, block_hash: int, replica_id: str) -> None:
        by_replica = self._pending.get(block_hash)
        if by_replica is not None:
            by_replica.pop(replica_id, None)
            if not by_replica:
                del self._pending[block_hash]

    def record_dispatch(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        pending = self._dispatched.setdefault(replica_id, {})
        expires_s = now_s + self.dispatch_ttl_s
        for h in block_hashes:
            pending[h] = expires_s
            self._pending.setdefault(h, {})[replica_id] = expires_s

    def hits(self, block_hashes: Sequence[int], now_s: float) -> dict[str, int]:
        """leading_hits of every replica holding at least the chain's first block, by replica
        (a replica left out holds none): the hash index names the replicas holding the first
        block, and only those walk the chain. At 1,000 replicas a prefix is held by a few."""
        if not block_hashes:
            return {}
        return {rid: self.leading_hits(rid, block_hashes, now_s) for rid in self._holders_of(block_hashes[0], now_s)}

    def _holders_of(self, block_hash: int, now_s: float) -> set[str]:
        """Every replica holding the block: reported, or sent it and not expired."""
        holders = self._holders.get(block_hash)
        here = set() if holders is None else ({holders} if isinstance(holders, str) else set(holders))
        pending = self._pending.get(block_hash)
        if pending:
            here.update(rid for rid, expires_s in pending.items() if expires_s > now_s)
        return here

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

    def reported_hashes(self, replica_id: str) -> Set[int]:
        """The hashes the replica's reports say it holds (not a copy: do not change it)."""
        return self._reported.get(replica_id, frozenset())

    def is_exact(self, replica_id: str) -> bool:
        """Whether the replica's reported set missed no change (false after a gap, or before any
        report)."""
        return replica_id in self._reported and replica_id not in self._inexact

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in `replica_ids` (dead or scaled down)."""
        keep = set(replica_ids)
        for replica_id in [r for r in self._reported if r not in keep]:
            for h in self._reported[replica_id]:
                self._drop_holder(h, replica_id)
        for replica_id in [r for r in self._dispatched if r not in keep]:
            for h in self._dispatched[replica_id]:
                self._drop_pending(h, replica_id)
        for table in (self._reported, self._dispatched, self._cache_seq):
            for replica_id in [r for r in table if r not in keep]:
                del table[replica_id]
        self._inexact &= keep

    @property
    def replica_ids(self) -> set[str]:
        return set(self._reported) | set(self._dispatched)
