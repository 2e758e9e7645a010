"""Routing policies: pure scorers over a snapshot of the replicas. No Ray, no torch.

The prefix-aware policy sends a request where its prompt's leading KV blocks already are, unless
that costs more in queueing than the hit saves:

    score = prefix_weight * hit_fraction - load_weight * load / max_load - kv_weight * kv_pressure

- hit_fraction: leading blocks of the request's hash chain the replica holds, over the chain's
  length. The hashes are the engine's own (model_worker.sched.hashing), so a predicted hit is a real
  hit: nothing here matches characters or approximates a tree.
- load / max_load: the replica's requests (waiting + running) over the busiest replica's, so the
  term is 0..1 like the others and means "relative to the rest" at any scale.
- kv_pressure: the fraction of KV blocks in use (0 before the replica's first report: a replica
  that has not reported is new). A replica without the free blocks the request's uncached part
  needs would preempt to admit it, so it is skipped while another has room.

Defaults and why: prefix_weight 1.0 and load_weight 0.5 mean a full hit beats an idle replica
only while the holder carries less than about twice the others' load (a prefill saved is worth
some queueing, not unbounded queueing). kv_weight 0.25 breaks near ties toward free memory.
imbalance_threshold 8: once the busiest replica has 8 more requests than the idlest, affinity is
ignored and the least-loaded replica wins, so a popular prefix cannot pile work on one replica
(SGLang's cache-aware router guards the same way). Ties (scores within 1e-12 of the best) go to a
random replica.

Policies score a ReplicaTable, the candidates as numpy columns, so one decision over 1,000
replicas is a few array operations rather than a Python loop over them. `choose` takes snapshots
(the real router's per-request view) or a table a caller keeps up to date in place (the
simulator, simulator/cluster.py); both give the same choice for the same random state.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

POLICIES = ("prefix_aware", "pow2", "round_robin", "random")


@dataclass(slots=True, frozen=True)
class ReplicaSnapshot:
    replica_id: str
    # Requests the replica holds: waiting for admission plus running.
    load: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int


class ReplicaTable:
    """Replicas as columns, in a fixed order: ids, load, free and total KV blocks. A caller that
    routes many requests over the same replicas keeps one and sets `load[i]`, `free[i]` and
    `total[i]` as they change; `position` maps an id to its row."""

    __slots__ = ("ids", "position", "load", "free", "total", "_sorted_ids")

    def __init__(self, ids: Sequence[str], load: Sequence[int] | None = None, free: Sequence[int] | None = None,
                 total: Sequence[int] | None = None) -> None:
        n = len(ids)
        self.ids = list(ids)
        self.position = {rid: i for i, rid in enumerate(self.ids)}
        self.load = np.zeros(n, dtype=np.int64) if load is None else np.asarray(load, dtype=np.int64)
        self.free = np.zeros(n, dtype=np.int64) if free is None else np.asarray(free, dtype=np.int64)
        self.total = np.zeros(n, dtype=np.int64) if total is None else np.asarray(total, dtype=np.int64)
        self._sorted_ids: list[str] | None = None

    @classmethod
    def from_snapshots(cls, replicas: Sequence[ReplicaSnapshot]) -> ReplicaTable:
        return cls([r.replica_id for r in replicas], [r.load for r in replicas],
                   [r.num_free_kv_blocks for r in replicas], [r.num_total_kv_blocks for r in replicas])

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def sorted_ids(self) -> list[str]:
        if self._sorted_ids is None:
            self._sorted_ids = sorted(self.ids)
        return self._sorted_ids

    def hit_column(self, hits: Mapping[str, int]) -> np.ndarray:
        """hits[replica_id] per row (0 for a replica not in hits; ids not in the table ignored)."""
        column = np.zeros(len(self.ids), dtype=np.float64)
        position = self.position
        for rid, count in hits.items():
            row = position.get(rid)
            if row is not None:
                column[row] = count
        return column


@dataclass(slots=True, frozen=True)
class RouterConfig:
    policy: str = "prefix_aware"
    prefix_weight: float = 1.0
    load_weight: float = 0.5
    kv_weight: float = 0.25
    # Spread of load (max - min requests) past which only load counts.
    imbalance_threshold: int = 8

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        for name in ("prefix_weight", "load_weight", "kv_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.imbalance_threshold, int) or self.imbalance_threshold < 1:
            raise ValueError(f"imbalance_threshold must be an integer >= 1, got {self.imbalance_threshold!r}")


class Policy:
    """Chooses one replica id per request. `hits[replica_id]` is how many leading blocks of the
    request's chain (of `num_blocks`) that replica holds; `blocks_needed` is the request's total
    block count (prompt and output), for the KV check. Policies that ignore prefixes ignore both."""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng

    def choose(self, replicas: Sequence[ReplicaSnapshot] | ReplicaTable, hits: Mapping[str, int] | None = None,
               num_blocks: int = 0, blocks_needed: int = 0) -> str:
        table = replicas if isinstance(replicas, ReplicaTable) else ReplicaTable.from_snapshots(replicas)
        if not len(table):
            raise ValueError("no replica to route to")
        return self._choose(table, hits or {}, num_blocks, blocks_needed)

    def _choose(self, table: ReplicaTable, hits: Mapping[str, int], num_blocks: int, blocks_needed: int) -> str:
        raise NotImplementedError

    def _least_loaded(self, table: ReplicaTable, rows: Sequence[int] | np.ndarray) -> str:
        """A random one of the least loaded among `rows` (in the order given)."""
        loads = table.load[rows]
        lowest = np.flatnonzero(loads == loads.min())
        return table.ids[int(rows[int(lowest[self.rng.randrange(lowest.size)])])]


class RoundRobin(Policy):
    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._turn = 0

    def _choose(self, table, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        ordered = table.sorted_ids
        self._turn += 1
        return ordered[(self._turn - 1) % len(ordered)]


class RandomChoice(Policy):
    def _choose(self, table, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        return self.rng.choice(table.ids)


class PowerOfTwo(Policy):
    """The less loaded of two replicas drawn at random (Serve's default, on our load figures)."""

    def _choose(self, table, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        return self._least_loaded(table, self.rng.sample(range(len(table)), min(2, len(table))))


class PrefixAware(Policy):
    def _choose(self, table, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        loads = table.load
        low, high = int(loads.min()), int(loads.max())
        if high - low > self.config.imbalance_threshold:
            return self._least_loaded(table, np.arange(len(table)))
        hit = table.hit_column(hits)
        # A replica that cannot hold the request's uncached blocks would preempt to admit it.
        # Usually every replica can: then the columns are scored as they are, not copied. One
        # whose capacity is not known yet (no report: total 0) is not excluded.
        rows = np.flatnonzero((table.free >= blocks_needed - hit) | (table.total == 0))
        if rows.size in (0, len(table)):
            rows = None
        load, total, free = loads, table.total, table.free
        if rows is not None:
            load, total, free, hit = load[rows], total[rows], free[rows], hit[rows]
        max_load = max(high, 1)
        hit_fraction = hit / num_blocks if num_blocks else 0.0
        # 1 - free / total where the total is known, else 0: a replica that has not reported yet
        # is new, so empty. Scoring it as full, with the room check above excluding it, once put
        # 16 of a burst of 30 on the one of 3 replicas that had reported, until the imbalance
        # threshold let the others in.
        kv_pressure = np.where(total > 0, 1.0 - free / np.maximum(total, 1), 0.0)
        score = (self.config.prefix_weight * hit_fraction - self.config.load_weight * load / max_load
                 - self.config.kv_weight * kv_pressure)
        best = np.flatnonzero(score >= score.max() - 1e-12)
        if rows is not None:
            best = rows[best]
        # rng.choice(list) draws randrange(len): the same draw, without a list of (often all) ids.
        return table.ids[int(best[self.rng.randrange(best.size)])]


_POLICY_CLASSES: dict[str, type[Policy]] = {"prefix_aware": PrefixAware, "pow2": PowerOfTwo,
                                            "round_robin": RoundRobin, "random": RandomChoice}


def make_policy(config: RouterConfig, rng: random.Random | None = None) -> Policy:
    return _POLICY_CLASSES[config.policy](config, rng or random.Random())
