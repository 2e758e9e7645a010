"""Routing policies: pure scorers over a snapshot of the replicas. No Ray, no torch.

The prefix-aware policy sends a request where its prompt's leading KV blocks already are, unless
that costs more in queueing than the hit saves:

    score = prefix_weight * hit_fraction - load_weight * load / max_load - kv_weight * kv_pressure

- hit_fraction: leading blocks of the request's hash chain the replica holds, over the chain's
  length. The hashes are the engine's own (model_worker.hashing), so a predicted hit is a real
  hit: nothing here matches characters or approximates a tree.
- load / max_load: the replica's requests (waiting + running) over the busiest replica's, so the
  term is 0..1 like the others and means "relative to the rest" at any scale.
- kv_pressure: the fraction of KV blocks in use. A replica without the free blocks the request's
  uncached part needs would preempt to admit it, so it is skipped while another has room.

Defaults and why: prefix_weight 1.0 and load_weight 0.5 mean a full hit beats an idle replica
only while the holder carries less than about twice the others' load (a prefill saved is worth
some queueing, not unbounded queueing). kv_weight 0.25 breaks near ties toward free memory.
imbalance_threshold 8: once the busiest replica has 8 more requests than the idlest, affinity is
ignored and the least-loaded replica wins, so a popular prefix cannot pile work on one replica
(SGLang's cache-aware router guards the same way). Ties go to a random replica.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("prefix_aware", "pow2", "round_robin", "random")


@dataclass(slots=True, frozen=True)
class ReplicaSnapshot:
    replica_id: str
    # Requests the replica holds: waiting for admission plus running.
    load: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int


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

    def choose(self, replicas: Sequence[ReplicaSnapshot], hits: Mapping[str, int] | None = None,
               num_blocks: int = 0, blocks_needed: int = 0) -> str:
        if not replicas:
            raise ValueError("no replica to route to")
        return self._choose(replicas, hits or {}, num_blocks, blocks_needed)

    def _choose(self, replicas: Sequence[ReplicaSnapshot], hits: Mapping[str, int], num_blocks: int,
                blocks_needed: int) -> str:
        raise NotImplementedError

    def _least_loaded(self, replicas: Sequence[ReplicaSnapshot]) -> str:
        low = min(r.load for r in replicas)
        return self.rng.choice([r.replica_id for r in replicas if r.load == low])


class RoundRobin(Policy):
    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._turn = 0

    def _choose(self, replicas, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        ordered = sorted(r.replica_id for r in replicas)
        self._turn += 1
        return ordered[(self._turn - 1) % len(ordered)]


class RandomChoice(Policy):
    def _choose(self, replicas, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        return self.rng.choice(replicas).replica_id


class PowerOfTwo(Policy):
    """The less loaded of two replicas drawn at random (Serve's default, on our load figures)."""

    def _choose(self, replicas, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        return self._least_loaded(self.rng.sample(list(replicas), min(2, len(replicas))))


class PrefixAware(Policy):
    def _choose(self, replicas, hits, num_blocks, blocks_needed):  # type: ignore[no-untyped-def]
        loads = [r.load for r in replicas]
        if max(loads) - min(loads) > self.config.imbalance_threshold:
            return self._least_loaded(replicas)
        # A replica that cannot hold the request's uncached blocks would preempt to admit it.
        roomy = [r for r in replicas if r.num_free_kv_blocks >= blocks_needed - hits.get(r.replica_id, 0)]
        max_load = max(max(loads), 1)
        best: list[str] = []
        best_score = float("-inf")
        for r in roomy or replicas:
            hit_fraction = hits.get(r.replica_id, 0) / num_blocks if num_blocks else 0.0
            kv_pressure = 1.0 - r.num_free_kv_blocks / r.num_total_kv_blocks if r.num_total_kv_blocks else 1.0
            score = (self.config.prefix_weight * hit_fraction - self.config.load_weight * r.load / max_load
                     - self.config.kv_weight * kv_pressure)
            if score > best_score + 1e-12:
                best, best_score = [r.replica_id], score
            elif abs(score - best_score) <= 1e-12:
                best.append(r.replica_id)
        return self.rng.choice(best)


_POLICY_CLASSES: dict[str, type[Policy]] = {"prefix_aware": PrefixAware, "pow2": PowerOfTwo,
                                            "round_robin": RoundRobin, "random": RandomChoice}


def make_policy(config: RouterConfig, rng: random.Random | None = None) -> Policy:
    return _POLICY_CLASSES[config.policy](config, rng or random.Random())
