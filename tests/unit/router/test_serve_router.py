"""PrefixAwareRouter's choice over fake replicas: the Serve glue that the policy tests do not see."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace


from contracts import RoutingReport
from contracts.serving import GenerateRequest
from model_worker import SamplingParams
from router import serve_router
from router.serve_router import PrefixAwareRouter


def make_router(policy: str = "pow2") -> PrefixAwareRouter:
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router._use_replica_queue_len_cache = False  # Serve's own count: the router does not read it
    router.initialize_state(policy=policy, seed=0)
    return router


def replica(unique_id: str, **stats) -> SimpleNamespace:
    report = {"replica_id": unique_id, "report_seq": 1, "num_total_kv_blocks": 100, "num_free_kv_blocks": 100,
              "block_size": 16, **stats}
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


def pending(request: GenerateRequest, request_id: str) -> SimpleNamespace:
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(internal_request_id=request_id))


def ids(ranked) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in group] for group in ranked]


def test_a_burst_of_choices_spreads_before_serve_counts_the_sends():
    """Serve counts a request against a replica only once it is sent; until then the router counts
    its own choices, so a burst does not pile onto the replica that looked idle."""
    router = make_router("prefix_aware")
    replicas = [replica("a"), replica("b")]
    chosen = [ids(asyncio.run(router.choose_replicas(
        replicas, pending(GenerateRequest([1, 2], SamplingParams(max_tokens=2)), f"r{i}"))))[0][0] for i in range(10)]
    assert sorted(chosen.count(r) for r in "ab") == [5, 5], chosen


def test_a_choice_counts_until_its_request_finishes_where_serve_sent_it(monkeypatch):
    router = make_router("prefix_aware")
    replicas = {u: replica(u) for u in "abc"}
    request = pending(GenerateRequest([1, 2], SamplingParams(max_tokens=2)), "r1")
    first = ids(asyncio.run(router.choose_replicas(list(replicas.values()), request)))
    chosen, fallback = first[0][0], first[1][0]
    loads = lambda: {u: router._snapshot(u, r, time.monotonic()).load for u, r in replicas.items()}  # noqa: E731
    assert loads()[chosen] == 1
    # The chosen replica did not answer Serve's probe: Serve sent the request to the fallback.
    router.on_request_routed(request, replicas[fallback].replica_id, None)
    assert loads() == {u: int(u == fallback) for u in "abc"}
    router.on_request_completed(replicas[chosen].replica_id, "r1")  # an earlier try's: not this one
    assert loads()[fallback] == 1
    router.on_request_completed(replicas[fallback].replica_id, "r1")
    assert loads() == {u: 0 for u in "abc"} and not router._dispatches
    # A choice Serve never confirms (the caller went away before the send) stops counting.
    lost = ids(asyncio.run(router.choose_replicas(list(replicas.values()),
                                                  pending(GenerateRequest([1, 2], SamplingParams(max_tokens=2)), "r2"))))
    assert loads()[lost[0][0]] == 1
    later = time.monotonic() + serve_router.UNROUTED_TTL_S + 1
    monkeypatch.setattr(serve_router.time, "monotonic", lambda: later)
    asyncio.run(router.choose_replicas(list(replicas.values()), None))
    assert "r2" not in router._dispatches and loads()[lost[0][0]] == 0


def test_the_fallback_goes_least_loaded_first():
    router = make_router("prefix_aware")
    replicas = [replica("a", num_running=5), replica("b", num_running=9), replica("c", num_running=0)]
    ranked = ids(choose(router, replicas, GenerateRequest([1, 2], SamplingParams(max_tokens=2))))
    assert ranked == [["c"], ["a", "b"]]


def test_each_report_is_folded_in_once_and_gone_replicas_are_forgotten():
    router = make_router("prefix_aware")
    hashes = [11, 22, 33]
    calls = []
    apply_report = router.index.apply_report
    router.index.apply_report = lambda rid, report, now: (calls.append((rid, report.cached_block_hashes)),
                                                          apply_report(rid, report, now))
    a, b = replica("a", cached_block_hashes=hashes), replica("b")
    for _ in range(3):
        choose(router, [a, b], GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
    assert calls == [("a", (11, 22, 33)), ("b", ())]  # three polls of the same reports: folded once
    a.routing_stats = {**a.routing_stats, "report_seq": 2, "cached_block_hashes": [11]}
    choose(router, [a, b], GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
    assert calls[-1] == ("a", (11,))
    choose(router, [a], GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
    assert router.index.replica_ids == {"a"} and set(router._report_seq) == {"a"}


def test_the_prefix_holder_wins_unless_other_callers_load_it_past_the_others():
    """Load is this router's requests on the replica plus the report's queued + running beyond
    what this router had there when the report came (other callers' requests)."""
    block = list(range(16))
    request = lambda: GenerateRequest(block * 2, SamplingParams(max_tokens=2), block_hashes=[7, 8])  # noqa: E731
    router = make_router("prefix_aware")
    holder, other = replica("holder", cached_block_hashes=[7, 8]), replica("other")
    assert ids(choose(router, [holder, other], request()))[0] == ["holder"]
    # Reported load alone (Serve has no count yet): a holder far busier than the threshold loses.
    busy = make_router("prefix_aware")
    holder_busy = replica("holder", cached_block_hashes=[7, 8], num_queued=20, num_running=10)
    assert ids(choose(busy, [holder_busy, replica("other")], request()))[0] == ["other"]
    # The same report, arriving while this router had 30 requests there: they were its own, and
    # they have all finished since.
    counted = make_router("prefix_aware")
    counted._routed["holder"] = 30
    choose(counted, [holder_busy, replica("other")], GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
    counted._routed["holder"] = 0
    assert ids(choose(counted, [holder_busy, replica("other")], request()))[0] == ["holder"]


def test_before_any_report_every_replica_is_a_candidate_and_no_block_size_is_assumed():
    router = make_router("prefix_aware")
    fresh = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u), routing_stats={}) for u in "ab"]
    ranked = choose(router, fresh, GenerateRequest([1] * 40, SamplingParams(max_tokens=8)))
    assert sorted(ids(ranked)[0] + (ids(ranked)[1] if len(ranked) > 1 else [])) == ["a", "b"]
    reported = RoutingReport.from_dict(replica("a").routing_stats)
    assert serve_router._blocks_needed(GenerateRequest([1] * 40, SamplingParams(max_tokens=8)), [None, None]) == 0
    assert serve_router._blocks_needed(GenerateRequest([1] * 40, SamplingParams(max_tokens=8)), [reported]) == 3


def test_deltas_in_the_routing_stats_reach_the_index_even_with_no_decision_to_read_them(monkeypatch):
    """Serve calls update_replicas as each new report comes: the router folds it in then, so a
    router with no traffic for longer than a delta covers still holds the replica's exact set."""
    from model_worker.sched.block_pool import BlockPool
    from router.report_builder import RoutingReportBuilder

    monkeypatch.setattr(serve_router.RequestRouter, "update_replicas", lambda self, replicas: None)
    pool, builder = BlockPool(64), RoutingReportBuilder(history=2)
    holder, other = replica("holder"), replica("other")
    router = make_router("prefix_aware")
    for step in range(10):  # ten report periods, no request: more than two reports behind
        (block,) = pool.allocate(1)
        pool.cache(block, 1000 + step, [step])
        holder.routing_stats = builder.build("holder", cache_seq=pool.cache_seq, changes_since=pool.changes_since,
                                             snapshot=pool.cached_hashes, num_free_kv_blocks=50,
                                             num_total_kv_blocks=64, block_size=16).to_dict()
        router.update_replicas([holder, other])
    assert not holder.routing_stats["cached_block_hashes"], "the last report is a delta"
    assert router.index.is_exact("holder") and router.index.num_delta_reports == 9
    request = GenerateRequest(list(range(16)) * 10, SamplingParams(max_tokens=2),
                              block_hashes=[1000 + i for i in range(10)])
    assert ids(choose(router, [holder, other], request))[0] == ["holder"]


def test_replicas_that_have_not_reported_yet_take_their_share_of_a_burst():
    """Capacity unknown is not capacity full: a burst while two of three replicas have no report
    yet once put 16 of 30 on the third (CI), each held back until the imbalance threshold."""
    router = make_router("prefix_aware")
    fresh = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u), routing_stats={}) for u in "bc"]
    replicas = [replica("a"), *fresh]
    chosen = [ids(asyncio.run(router.choose_replicas(
        replicas, pending(GenerateRequest(list(range(40)), SamplingParams(max_tokens=4)), f"r{i}"))))[0][0]
        for i in range(30)]
    assert sorted(chosen.count(r) for r in "abc") == [10, 10, 10], chosen
