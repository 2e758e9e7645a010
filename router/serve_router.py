"""PrefixAwareRouter: the Ray Serve RequestRouter on the LLMServer deployment.

It runs inside every caller's handle (the ingress replicas), so a routing decision is local: no
RPC and no `ray.get` on the request path. Inputs, freshest first:
- the request object itself (`contracts.serving.GenerateRequest.block_hashes`, computed once by
  the ingress with the engine's hash function and the request's cache key);
- Serve's per-replica count of ongoing requests, updated as this router sends and as requests
  finish (the load term);
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
from collections import deque
from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from contracts import RoutingReport
from contracts.serving import GenerateRequest
from router.policy import ReplicaSnapshot, RouterConfig, make_policy
from router.prefix_index import PrefixIndex

# A choice that no send followed within this long (a retry chose again) stops counting as load.
UNSENT_TTL_S = 1.0


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
        # replica id -> times of choices not sent yet. Serve counts a request against a replica
        # once it is sent, and a burst's decisions run ahead of the sends: without these, every
        # request of a burst would see the same loads and pick the same replica.
        self._unsent: dict[str, deque[float]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        started_s = time.perf_counter()
        now_s = time.monotonic()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        reports = self._fold_reports(by_id, now_s)
        request = _generate_request(pending_request)
        eligible = _eligible(reports, request)
        hashes = request.block_hashes if request is not None else []
        snapshots = [self._snapshot(replica_id, by_id[replica_id], now_s) for replica_id in eligible]
        hits = self.index.hits(hashes, now_s) if hashes else {}  # the policy reads only the eligible
        chosen = self.policy.choose(snapshots, hits, len(hashes), _blocks_needed(request, reports.values()))
        if hashes:
            self.index.record_dispatch(chosen, hashes, now_s)
        self._unsent.setdefault(chosen, deque()).append(now_s)
        if request is not None:
            request.routed_replica_id = chosen  # the caller's own object: it names a replica that hangs
        self.decision_times_s.append(time.perf_counter() - started_s)
        # The rest is Serve's fallback, tried (least loaded first) only when the chosen replica does
        # not answer Serve's queue-length probe or is full: a frozen replica costs one probe timeout.
        rest = [by_id[rid] for rid in eligible if rid != chosen]
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

    def on_send_request(self, replica_id: Any) -> None:
        """Serve counts the request against the replica from now on: stop counting it here."""
        super().on_send_request(replica_id)
        unsent = self._unsent.get(replica_id.unique_id)
        if unsent:
            unsent.popleft()

    def _fold_reports(self, by_id: dict[str, RunningReplica], now_s: float) -> dict[str, RoutingReport | None]:
        """Each candidate's report (None before its first); a new one is parsed and folded into
        the index once. Replicas that are gone are forgotten."""
        reports = {replica_id: self._report_of(replica_id, replica, now_s) for replica_id, replica in by_id.items()}
        if self.index.replica_ids - set(by_id) or set(self._parsed) - set(by_id):
            self.index.retain(by_id)
            self._report_seq = {k: v for k, v in self._report_seq.items() if k in by_id}
            self._parsed = {k: v for k, v in self._parsed.items() if k in by_id}
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
            self.index.apply_report(replica_id, report, now_s)
        return report

    def _snapshot(self, replica_id: str, replica: RunningReplica, now_s: float) -> ReplicaSnapshot:
        """Load is Serve's count of requests sent to the replica and not finished (fresh, kept by
        every caller's router); before Serve has one, the replica's last report."""
        report = self._report_of(replica_id, replica, now_s) or RoutingReport(replica_id, 0)
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        load = ongoing if ongoing is not None else report.num_queued + report.num_running
        unsent = self._unsent.get(replica_id)
        while unsent and unsent[0] < now_s - UNSENT_TTL_S:  # chosen on a try that was not sent
            unsent.popleft()
        load += len(unsent or ())
        if report.report_seq == 0:  # no report yet: capacity unknown, assume it is all free
            return ReplicaSnapshot(replica_id, int(load), 0, 0)
        return ReplicaSnapshot(replica_id, int(load), report.num_free_kv_blocks, report.num_total_kv_blocks)


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
