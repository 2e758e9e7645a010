"""PrefixAwareRouter's load count against Serve's own bookkeeping (Ray Serve's real queue-length
cache, no cluster): the calls Serve makes around each decision, replayed in the order a loaded
machine gives them."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from ray.serve._private.request_router.common import ReplicaQueueLengthCache

from contracts.serving import GenerateRequest
from model_worker import SamplingParams
from router.serve_router import PrefixAwareRouter

pytestmark = pytest.mark.integration


def routing_stats(unique_id: str) -> dict:
    return {"replica_id": unique_id, "report_seq": 1, "num_total_kv_blocks": 100, "num_free_kv_blocks": 100,
            "block_size": 16}


def pending(request: GenerateRequest, request_id: str) -> SimpleNamespace:
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(internal_request_id=request_id))


@dataclass(frozen=True)
class ReplicaKey:
    unique_id: str


def test_a_burst_under_serves_own_bookkeeping_counts_every_request_where_it_is():
    """Serve's calls around each decision as a loaded machine orders them: the send, the replica's
    answer a step later (its own count then, which overwrites Serve's), the finish two steps on
    and its callback later still. Serve's count is wrong in between (CI once put 16 of 30 on one
    of 3 identical replicas through it); the router's own count must equal the truth at every
    decision, and the burst must spread."""
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router._use_replica_queue_len_cache = True  # Serve's own bookkeeping runs as it does for real
    router._update_router_queue_len_gauge = lambda *args: None
    router.initialize_state(policy="prefix_aware", seed=0)
    replicas = {u: SimpleNamespace(replica_id=ReplicaKey(u), routing_stats=routing_stats(u)) for u in "abc"}
    events: list[tuple[int, int, str, str, SimpleNamespace]] = []
    at_replica, in_flight, sent = Counter(), Counter(), Counter()
    for step in range(60):
        for event in sorted(e for e in events if e[0] <= step):
            events.remove(event)
            _, order, kind, rid, request = event
            if kind == "accept":
                at_replica[rid] += 1
                router.on_new_queue_len_info(replicas[rid].replica_id, at_replica[rid])
                router.on_request_routed(request, replicas[rid].replica_id, None)
                events.append((step + 2, order, "finish", rid, request))
            elif kind == "finish":
                at_replica[rid] -= 1
                events.append((step + 1, order, "done", rid, request))
            else:
                in_flight[rid] -= 1
                router.decrement_queue_len_cache(replicas[rid].replica_id)
                router.on_request_completed(replicas[rid].replica_id, request.metadata.internal_request_id)
        if step >= 30:
            continue
        now = time.monotonic()
        assert {u: router._snapshot(u, r, now).load for u, r in replicas.items()} == {u: in_flight[u] for u in "abc"}
        request = pending(GenerateRequest([1, 2], SamplingParams(max_tokens=2)), f"r{step}")
        rid = asyncio.run(router.choose_replicas(list(replicas.values()), request))[0][0].replica_id.unique_id
        router.on_send_request(replicas[rid].replica_id)
        in_flight[rid] += 1
        sent[rid] += 1
        events.append((step + 1, step, "accept", rid, request))
    assert not router._dispatches and max(sent.values()) <= 12, sent
