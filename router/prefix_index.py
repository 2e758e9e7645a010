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
        reported.difference_update(report.removed_block_hashes)
        reported.update(report.stored_block_hashes)
        self._cache_seq[replica_id] = report.cache_seq
        self._prune_dispatched(replica_id, reported, now_s)
        return replica_id not in self._inexact

    def _set_reported(self, replica_id: str, reported: set[int], now_s: float) -> None:
        self._reported[replica_id] = reported
        self._prune_dispatched(replica_id, reported, now_s)

    def _prune_dispatched(self, replica_id: str, reported: Set[int], now_s: float) -> None:
        """Drop dispatched entries that expired or that the report now confirms."""
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
        for table in (self._reported, self._dispatched, self._cache_seq):
            for replica_id in [r for r in table if r not in keep]:
                del table[replica_id]
        self._inexact &= keep

    @property
    def replica_ids(self) -> set[str]:
        return set(self._reported) | set(self._dispatched)
