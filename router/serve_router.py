"""PrefixAwareRouter: the Ray Serve RequestRouter on the LLMServer deployment.

It runs inside every caller's handle (the ingress replicas), so a routing decision is local: no
RPC and no `ray.get` on the request path. Inputs, freshest first:
- the request object itself (`contracts.serving.GenerateRequest.block_hashes`, computed once by
  the ingress with the engine's hash function and the request's cache key);
- its own count of the requests it routed to each replica and that have not finished (the load
  term, exact for this caller), plus, from each replica's last report, the requests other callers
  hold there;
- each replica's `record_routing_stats` report, polled by the Serve controller every
  `request_routing_stats_period_s` (free KV blocks, and the prefix cache's changes since a few
  reports back or now and then all its hashes: router/report_builder.py), folded into the
  PrefixIndex as Serve delivers it (`update_replicas`) and when a decision reads it;
- this router's own dispatches, recorded in the PrefixIndex at once.
Selected with `router: {policy: ...}` in the application args (deployments/app_config.py).
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from contracts import RoutingReport
from contracts.serving import GenerateRequest
from router.policy import ReplicaSnapshot, RouterConfig, make_policy
from router.prefix_index import PrefixIndex

# A choice that Serve has not confirmed as taken by a replica within this long (the request was
# cancelled, or its send failed and no retry followed) stops counting as load.
UNROUTED_TTL_S = 5.0


@dataclass(slots=True)
class _Dispatch:
    replica_id: str
    chosen_s: float
    # Serve confirmed that the replica took it (`on_request_routed`): it counts until it finishes.
    routed: bool = False


class PrefixAwareRouter(RequestRouter):
    """No FIFOMixin: with it, Serve hands the replica chosen for one request to whichever request
    is oldest in the queue, so a choice made from one prompt's hashes would serve another prompt.
    The base class gives each decision to the request it was made for."""

    def initialize_state(self, policy: str = "prefix_aware", dispatch_ttl_s: float = 10.0, seed: int | None = None,
                         **weights: Any) -> None:
        self.router_config = RouterConfig(policy=policy, **weights)
        self.policy = make_policy(self.router_config, random.Random(seed))
        self.index = PrefixIndex(dispatch_ttl_s)
        # replica id -> the `report_seq` of its last report folded into the index.
        self._report_seq: dict[str, int] = {}
        # replica id -> (the routing_stats dict Serve last gave, its RoutingReport): a report is
        # parsed once when it arrives, not at every decision (a snapshot carries every cached hash).
        self._parsed: dict[str, tuple[Any, RoutingReport | None]] = {}
        # Seconds per decision, for the overhead figure in docs/architecture.md.
        self.decision_times_s: deque[float] = deque(maxlen=10_000)
        # This router's requests, by Serve's internal request id, from the decision until they
        # finish. Serve's own per-replica count is no load figure: each replica's answer to a send
        # overwrites it with the replica's count at that moment, which leaves out the requests
        # still on their way there and those whose finish has not reached the router yet (then
        # decremented again), so under a burst on a loaded machine it undercounts a slow replica
        # and piles work onto it (tests/integration/test_router_bookkeeping.py replays it).
        self._dispatches: dict[str, _Dispatch] = {}
        self._routed: Counter[str] = Counter()  # replica id -> this router's requests it took
        self._unrouted: Counter[str] = Counter()  # replica id -> choices not confirmed yet
        self._unrouted_ids: dict[str, None] = {}  # their request ids, oldest choice first
        # replica id -> this router's routed count when the replica's last report arrived: the
        # report's queued + running beyond it are other callers' requests.
        self._routed_at_report: dict[str, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        started_s = time.perf_counter()
        now_s = time.monotonic()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        reports = self._fold_reports(by_id, now_s)
        self._expire_unrouted(now_s)
        request = _generate_request(pending_request)
        eligible = _eligible(reports, request)
        hashes = request.block_hashes if request is not None else []
        snapshots = [self._snapshot(replica_id, by_id[replica_id], now_s) for replica_id in eligible]
        hits = self.index.hits(hashes, now_s) if hashes else {}  # the policy reads only the eligible
        chosen = self.policy.choose(snapshots, hits, len(hashes), _blocks_needed(request, reports.values()))
        if hashes:
            self.index.record_dispatch(chosen, hashes, now_s)
        request_id = _request_id(pending_request)
        if request_id is not None:
            self._track(request_id, _Dispatch(chosen, now_s))
        if request is not None:
            request.routed_replica_id = chosen  # the caller's own object: it names a replica that hangs
        self.decision_times_s.append(time.perf_counter() - started_s)
        # The rest is Serve's fallback, tried only when the chosen replica does not answer Serve's
        # queue-length probe or is full: a frozen replica costs one probe timeout. Serve takes the
        # lowest of its own counts there and the first on a tie, so the rest go least loaded first
        # by this router's count (in candidate order, every fallback would go to the same one).
        loads = {snapshot.replica_id: snapshot.load for snapshot in snapshots}
        rest = [by_id[rid] for rid in sorted(eligible, key=loads.__getitem__) if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set, sent whenever a replica's routing stats change: each new
        report is folded in now, so that a router with no requests for a while still applies
        every delta (a delta covers only a few periods; past that the replica waits for its next
        snapshot). A report that does not parse is left for the next decision to raise."""
        super().update_replicas(replicas)
        now_s = time.monotonic()
        for replica in replicas:
            try:
                self._report_of(replica.replica_id.unique_id, replica, now_s)
            except ValueError:
                pass

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica took the request: it counts there (where Serve sent it, which is another
        replica than the choice when the chosen one did not answer) until it finishes."""
        super().on_request_routed(pending_request, replica_id, result)
        request_id = _request_id(pending_request)
        if request_id is not None:
            self._track(request_id, _Dispatch(replica_id.unique_id, time.monotonic(), routed=True))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Finished, failed or cancelled on `replica_id`. The completion of an earlier try (a
        rejected send) leaves the request's newer choice of another replica counting."""
        super().on_request_completed(replica_id, internal_request_id)
        dispatch = self._dispatches.get(internal_request_id)
        if dispatch is not None and dispatch.replica_id == replica_id.unique_id:
            self._track(internal_request_id, None)

    def _track(self, request_id: str, dispatch: _Dispatch | None) -> None:
        """Sets (or, with None, ends) the request's dispatch, keeping the per-replica counts."""
        old = self._dispatches.pop(request_id, None)
        if old is not None:
            (self._routed if old.routed else self._unrouted)[old.replica_id] -= 1
            self._unrouted_ids.pop(request_id, None)
        if dispatch is not None:
            self._dispatches[request_id] = dispatch
            (self._routed if dispatch.routed else self._unrouted)[dispatch.replica_id] += 1
            if not dispatch.routed:
                self._unrouted_ids[request_id] = None

    def _expire_unrouted(self, now_s: float) -> None:
        """Drops choices Serve never confirmed within UNROUTED_TTL_S (oldest first: every
        choice is inserted anew, so the order is the order of the choices)."""
        unrouted = self._unrouted_ids
        while unrouted:
            request_id = next(iter(unrouted))
            if self._dispatches[request_id].chosen_s >= now_s - UNROUTED_TTL_S:
                break
            self._track(request_id, None)

    def _fold_reports(self, by_id: dict[str, RunningReplica], now_s: float) -> dict[str, RoutingReport | None]:
        """Each candidate's report (None before its first); a new one is parsed and folded into
        the index once. Replicas that are gone are forgotten."""
        reports = {replica_id: self._report_of(replica_id, replica, now_s) for replica_id, replica in by_id.items()}
        if self.index.replica_ids - set(by_id) or set(self._parsed) - set(by_id):
            self.index.retain(by_id)
            self._report_seq = {k: v for k, v in self._report_seq.items() if k in by_id}
            self._parsed = {k: v for k, v in self._parsed.items() if k in by_id}
            self._routed_at_report = {k: v for k, v in self._routed_at_report.items() if k in by_id}
        return reports

    def _report_of(self, replica_id: str, replica: RunningReplica, now_s: float) -> RoutingReport | None:
        stats = replica.routing_stats
        parsed = self._parsed.get(replica_id)
        if parsed is not None and parsed[0] is stats:
            return parsed[1]
        report = RoutingReport.from_dict(stats)
        self._parsed[replica_id] = (stats, report)
        if report is not None and self._report_seq.get(replica_id) != report.report_seq:
            self._report_seq[replica_id] = report.report_seq
            self._routed_at_report[replica_id] = self._routed[replica_id]
            self.index.apply_report(replica_id, report, now_s)
        return report

    def _snapshot(self, replica_id: str, replica: RunningReplica, now_s: float) -> ReplicaSnapshot:
        """Load is this router's requests on the replica (chosen or taken, not finished: fresh
        and exact) plus other callers' there: the replica's last report of queued + running
        beyond this router's count when that report arrived."""
        report = self._report_of(replica_id, replica, now_s) or RoutingReport(replica_id, 0)
        others = report.num_queued + report.num_running - self._routed_at_report.get(replica_id, 0)
        load = self._routed[replica_id] + self._unrouted[replica_id] + max(others, 0)
        if report.report_seq == 0:  # no report yet: capacity unknown, assume it is all free
            return ReplicaSnapshot(replica_id, int(load), 0, 0)
        return ReplicaSnapshot(replica_id, int(load), report.num_free_kv_blocks, report.num_total_kv_blocks)


def _request_id(pending_request: PendingRequest | None) -> str | None:
    """Serve's internal id of the request (the same over its retries), None for a bare call."""
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None)


def _generate_request(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest a call carries (LLMServer's methods take it first), or None for the
    deployment's other methods (broadcasts, health): those are routed on load alone."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerateRequest) else None


def _eligible(reports: dict[str, RoutingReport | None], request: GenerateRequest | None) -> list[str]:
    """Replica ids a request may go to: not one it already failed on (`avoid_replica_ids`), not
    one whose last report says its engine stopped. If that leaves none, all: a try beats a wait."""
    avoid = set(request.avoid_replica_ids) if request is not None else set()
    eligible = [rid for rid, report in reports.items()
                if rid not in avoid and (report is None or report.engine_running)]
    return eligible or list(reports)


def _blocks_needed(request: GenerateRequest | None, reports: Iterable[RoutingReport | None]) -> int:
    """KV blocks the request will hold at its longest: prompt plus max_tokens, in the block size
    the replicas report (0, no constraint, before any has reported)."""
    block_size = next((report.block_size for report in reports if report and report.block_size), 0)
    if request is None or not block_size:
        return 0
    return -(-(len(request.prompt_token_ids) + request.params.max_tokens) // block_size)
