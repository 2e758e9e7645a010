"""PrefixAwareRouter's choice over fake replicas: the Serve glue that the policy tests do not see."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deployments.protocol import GenerateRequest
from model_worker import SamplingParams
from router.serve_router import PrefixAwareRouter


class FakeQueueLens:
    def get(self, replica_id):
        return None


def make_router(policy: str = "pow2") -> PrefixAwareRouter:
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router._replica_queue_len_cache = FakeQueueLens()
    router.initialize_state(policy=policy, seed=0)
    return router


def replica(unique_id: str, **stats) -> SimpleNamespace:
    report = {"report_seq": 1, "num_total_kv_blocks": 100, "num_free_kv_blocks": 100, "block_size": 16, **stats}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id), routing_stats=report)


def choose(router, replicas, request):
    pending = SimpleNamespace(args=[request])
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_a_retry_avoids_the_replicas_that_failed_it_and_the_choice_is_written_back():
    router = make_router()
    replicas = [replica("a"), replica("b"), replica("c")]
    for _ in range(20):
        request = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=4), avoid_replica_ids=["a", "b"])
        ranked = choose(router, replicas, request)
        assert [r.replica_id.unique_id for r in ranked[0]] == ["c"]
        assert request.routed_replica_id == "c"


def test_replicas_whose_engine_stopped_are_skipped_unless_none_is_left():
    router = make_router()
    dead = replica("dead", engine_running=False)
    for _ in range(20):
        ranked = choose(router, [dead, replica("ok")], GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
        assert [[r.replica_id.unique_id for r in group] for group in ranked] == [["ok"]]
    only = choose(router, [dead], GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
    assert only[0][0].replica_id.unique_id == "dead"  # a try beats waiting forever


def test_the_other_eligible_replicas_are_serves_fallback():
    """Serve tries the second rank only if the chosen replica does not answer its probe (frozen)."""
    router = make_router()
    ranked = choose(router, [replica("a"), replica("b"), replica("c")],
                    GenerateRequest([1, 2], SamplingParams(max_tokens=2), avoid_replica_ids=["b"]))
    assert len(ranked) == 2 and len(ranked[0]) == 1
    assert {r.replica_id.unique_id for r in ranked[0] + ranked[1]} == {"a", "c"}
