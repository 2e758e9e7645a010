"""What a replica reports through Serve's two polling hooks, each with its one conversion.

Serve's hooks must return plain dicts (`record_routing_stats`) and numbers
(`record_autoscaling_stats`), and hand those dicts to the routers and the autoscaling policy as
they came. So each report is a dataclass the replica fills and the reader parses back: the keys
exist once, here, and a reader cannot ask for a key the writer does not send.

One meaning per name, here and in every package:
- `num_queued` here, `EngineStats.num_waiting` in the engine (vLLM's meaning): requests in the
  engine's scheduler queue, not yet scheduled.
- `num_waiting_first_token`: requests admitted (by a replica here and in the autoscaler's
  `ReplicaLoad`; by an ingress in its admission snapshot) that have no first token yet, queued or
  prefilling: the queue the autoscaler scales on and admission control sheds by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contracts.checks import is_int


@dataclass(slots=True, frozen=True)
class RoutingReport:
    """A replica's state for the request routers (router/serve_router.py)."""

    replica_id: str
    # Increases with every report, so a router folds each report in once.
    report_seq: int
    # False once the engine stopped: routers skip the replica before Serve replaces it.
    engine_running: bool = True
    num_queued: int = 0
    num_running: int = 0
    num_free_kv_blocks: int = 0
    num_total_kv_blocks: int = 0
    # Tokens per KV block: how a router turns prompt + max_tokens into blocks needed.
    block_size: int = 0
    # A full snapshot (delta_base_seq -1): every block hash the replica's prefix cache holds.
    cached_block_hashes: tuple[int, ...] = ()
    # The prefix cache's change counter (BlockPool.cache_seq) this report brings a reader up to.
    cache_seq: int = 0
    # -1: a full snapshot, in cached_block_hashes. Otherwise a delta, valid for a reader whose
    # set is that of any cache_seq from delta_base_seq to cache_seq: the hashes that entered or
    # left the cache after delta_base_seq, by where they are at cache_seq (a hash that came and
    # went is in removed). Applying it twice, or to a later set, changes nothing more.
    delta_base_seq: int = -1
    stored_block_hashes: tuple[int, ...] = ()
    removed_block_hashes: tuple[int, ...] = ()

    @property
    def is_snapshot(self) -> bool:
        return self.delta_base_seq < 0

    @property
    def num_hashes(self) -> int:
        """Hashes the report carries: what its size grows with."""
        return len(self.cached_block_hashes) + len(self.stored_block_hashes) + len(self.removed_block_hashes)

    def to_dict(self) -> dict[str, Any]:
        """The dict `record_routing_stats` returns (Serve passes it to routers as it is)."""
        out = dataclasses.asdict(self)
        for name in _HASH_FIELDS:
            out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any] | None) -> RoutingReport | None:
        """The report in `stats`, or None when the replica has not reported yet (Serve gives an
        empty dict until the first poll). A report with wrong types is a ValueError."""
        if not stats:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"replica_id", "report_seq"} - set(stats)
        if missing:
            raise ValueError(f"routing report without {sorted(missing)}: {sorted(stats)}")
        values = {k: v for k, v in stats.items() if k in names}
        for name in _HASH_FIELDS:
            hashes = values.get(name, ())
            if not isinstance(hashes, (list, tuple)) or not all(type(h) is int for h in hashes):
                raise ValueError(f"routing report field {name} must be a list of ints")
            values[name] = tuple(hashes)
        report = cls(**values)
        _check_types(report)
        _check_cache_fields(report)
        return report


# The report's hash lists: lists in the dict, tuples in the type.
_HASH_FIELDS = ("cached_block_hashes", "stored_block_hashes", "removed_block_hashes")


def _check_cache_fields(report: RoutingReport) -> None:
    """A snapshot carries no changes and a delta no snapshot, and a delta's base precedes it."""
    if report.delta_base_seq < -1 or report.cache_seq < 0:
        raise ValueError(f"routing report with cache_seq {report.cache_seq} and delta_base_seq "
                         f"{report.delta_base_seq}: cache_seq must be >= 0 and delta_base_seq >= -1")
    if report.is_snapshot and (report.stored_block_hashes or report.removed_block_hashes):
        raise ValueError("a full routing report (delta_base_seq -1) cannot carry stored or removed hashes")
    if not report.is_snapshot and (report.cached_block_hashes or report.delta_base_seq > report.cache_seq):
        raise ValueError(f"a delta routing report (base {report.delta_base_seq}, cache_seq {report.cache_seq}) "
                         "must carry no cached_block_hashes and a base <= its cache_seq")


@dataclass(slots=True, frozen=True)
class LoadReport:
    """A replica's load for the autoscaler (autoscaler/serve_policy.py)."""

    num_waiting_first_token: int
    # Age of the oldest request without a first token (0 when none waits).
    oldest_wait_s: float
    num_running: int
    # Share of KV blocks in use, 0..1.
    kv_usage: float
    # Requests the engine runs at once (max_num_seqs): the autoscaler sizes surges in seats.
    num_seats: int
    # Requests this replica refused with 429, since it started.
    num_shed: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    # TTFT p90 over the replica's recent window; None when no first token came in it.
    ttft_p90_s: float | None = None

    def to_metrics(self) -> dict[str, float]:
        """What `record_autoscaling_stats` returns: numbers only (Serve drops a replica's metrics
        if one value is not an int or float), so an absent TTFT is left out, not None."""
        return {k: float(v) for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def metric_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _check_types(report: Any) -> None:
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        expected = {"str": str, "int": int, "bool": bool}.get(str(f.type))
        if expected is int and not is_int(value):
            raise ValueError(f"routing report field {f.name} must be an int, got {value!r}")
        if expected in (str, bool) and not isinstance(value, expected):
            raise ValueError(f"routing report field {f.name} must be a {expected.__name__}, got {value!r}")
