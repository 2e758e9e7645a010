"""RoutingReportBuilder: a replica's routing reports, as changes to its prefix cache. Pure.

A report with every cached hash costs a 64-bit hash per cached block per period (about 2 MB of
JSON at 100,000 blocks, each period, to every router). The builder sends what changed instead,
from the block pool's change log (model_worker.sched.block_pool.BlockPool.changes_since), and a full
snapshot only when a delta cannot be made or might not be applicable for long:
- the first report, and every `full_report_every`-th (60 by default: a router that could apply
  no delta, a new one included, knows the replica's cache again within that many periods);
- when the pool's log no longer reaches the delta's base (it overflowed, or the cache was reset).

Routers can miss reports: Serve's controller keeps only each replica's latest dict (and drops a
call that times out), and a router reads what is there when it looks. So a delta is counted not
from the previous report but from the one `history` reports back (4 by default): a router whose
last applied report is any of those last `history` reports applies it exactly (the changes are
listed by where each hash is now, so they also fit a set later than the base; see
BlockPool.changes_since). A router further behind applies what it can and stays inexact until the
next snapshot (router.prefix_index.PrefixIndex.apply_report). The cost: each delta carries
`history` periods of changes, a few kilobytes at hundreds of tokens a second.

The builder takes the cache's state as callables, so the replica (LLMServer, over an engine in
another process) and the cluster simulator (over a BlockPool directly) run the same code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from contracts import RoutingReport

# (stored, removed) since a cache_seq, or None when the source cannot tell (a gap).
ChangesSince = Callable[[int], tuple[Sequence[int], Sequence[int]] | None]


class RoutingReportBuilder:
    def __init__(self, full_report_every: int = 60, history: int = 4) -> None:
        if full_report_every < 1:
            raise ValueError(f"full_report_every must be >= 1, got {full_report_every}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.full_report_every = full_report_every
        self.history = history
        # Increases with every report built (RoutingReport.report_seq).
        self.report_seq = 0
        # cache_seq of the last `history` reports whose cache state a router may hold, oldest first.
        self._recent_cache_seqs: deque[int] = deque(maxlen=history)
        self._reports_since_full = 0
        # Reports built as full snapshots and as deltas, and snapshots forced by a gap in the
        # source's log (those are among the full ones).
        self.num_full_reports = 0
        self.num_delta_reports = 0
        self.num_gaps = 0

    def next_base(self) -> int | None:
        """The cache_seq the next report's changes will be counted from, or None if it will be a
        full snapshot: what a caller that fetches the changes ahead (LLMServer) asks its source."""
        if not self._recent_cache_seqs or self._reports_since_full >= self.full_report_every - 1:
            return None
        return self._recent_cache_seqs[0]

    def build(self, replica_id: str, *, cache_seq: int, changes_since: ChangesSince,
              snapshot: Callable[[], Iterable[int]], num_queued: int = 0, num_running: int = 0,
              num_free_kv_blocks: int = 0, num_total_kv_blocks: int = 0, block_size: int = 0) -> RoutingReport:
        """The next report. `cache_seq`, `changes_since` and `snapshot` must describe the cache at
        one instant (BlockPool.cache_seq, .changes_since and .cached_hashes between two steps)."""
        self.report_seq += 1
        base = self.next_base()
        changes = changes_since(base) if base is not None else None
        if base is not None and changes is None:
            self.num_gaps += 1
            # The log does not reach back to these: later deltas count from this snapshot.
            self._recent_cache_seqs.clear()
        counts = dict(num_queued=num_queued, num_running=num_running, num_free_kv_blocks=num_free_kv_blocks,
                      num_total_kv_blocks=num_total_kv_blocks, block_size=block_size)
        if changes is None:
            report = RoutingReport(replica_id, self.report_seq, cached_block_hashes=tuple(snapshot()),
                                   cache_seq=cache_seq, **counts)
            self._reports_since_full = 0
            self.num_full_reports += 1
        else:
            stored, removed = changes
            report = RoutingReport(replica_id, self.report_seq, cache_seq=cache_seq, delta_base_seq=base,
                                   stored_block_hashes=tuple(stored), removed_block_hashes=tuple(removed), **counts)
            self._reports_since_full += 1
            self.num_delta_reports += 1
        self._recent_cache_seqs.append(cache_seq)
        return report

    def stopped(self, replica_id: str) -> RoutingReport:
        """The report of a replica whose engine stopped: routers skip it (and, a snapshot of
        nothing, forget its cache). Should an engine ever come back, its next report is full."""
        self.report_seq += 1
        self._recent_cache_seqs.clear()
        return RoutingReport(replica_id, self.report_seq, engine_running=False)
