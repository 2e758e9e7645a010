"""ReplicaCore: what one replica decides and reports, synchronous, with the clock passed in.

A replica admits a request or refuses it (a count-based backstop behind the ingress's admission:
autoscaler.admission.replica_policy), follows each admitted request to its first token and its
end, and reports twice over: its load and prefix cache to the request routers (RoutingReport, as
deltas of the cache, router/report_builder.py) and its queue to the autoscaler (LoadReport). All
of that is here, and nothing else: no Ray, no asyncio, no engine calls. Whoever owns the engine
takes the engine's stats and passes them in.

Two owners run it: LLMServer (deployments/llm_server.py) for Serve, over an AsyncLLMEngine and
the wall clock; and the cluster simulator's replica (simulator/replica.py), over an LLMEngine with
a simulated runner and a simulated clock. So a simulated replica admits, sheds and reports as a
served one does, by the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoscaler.admission import REPLICA_TTFT_WINDOW_S, AdmissionController, Ticket, replica_policy
from contracts import LoadReport, RoutingReport
from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from model_worker.config import SchedulerConfig
from router.report_builder import RoutingReportBuilder


class ReplicaOverloaded(Exception):
    """The replica refuses a request: too many admitted ones still wait for a first token."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class AdmittedRequest:
    """One request the replica admitted, followed to its first token and its end."""

    request_id: str
    ticket: Ticket
    # Continues another replica's output (migrated by the ingress): its first token here is no
    # time to first token.
    resumed: bool


class ReplicaCore:
    def __init__(self, replica_id: str, limits: SchedulerConfig, clock: Callable[[], float], *,
                 admission: dict[str, Any] | None = None, ttft_window_s: float = REPLICA_TTFT_WINDOW_S,
                 report_builder: RoutingReportBuilder | None = None) -> None:
        """`limits`: what the engine runs under. `admission`: replica_policy's keywords (the
        `admission` app arg)."""
        self.replica_id = replica_id
        self.limits = limits
        self.admission = AdmissionController(replica_policy(**(admission or {}), ttft_window_s=ttft_window_s),
                                             clock)
        # Routing reports as prefix-cache deltas, a snapshot now and then.
        self.routing_reports = report_builder or RoutingReportBuilder()
        # Requests that continued another replica's output, since start.
        self.num_resumed = 0

    @property
    def num_seats(self) -> int:
        """Requests the engine runs at once (max_num_seqs): the autoscaler sizes surges in seats."""
        return self.limits.max_num_seqs

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) this replica can ever run: the model's positions
        and the whole KV cache both bound it."""
        limits = self.limits
        return min(limits.max_model_len, limits.num_kv_blocks * limits.block_size)

    # ---- a request's life ---------------------------------------------------------------------

    def admit(self, request_id: str, priority: Priority, resumed: bool = False) -> AdmittedRequest:
        """Admit a request, or raise ReplicaOverloaded (nothing is held then). An admitted request
        must be ended with finished(), whatever happens to it."""
        verdict, ticket = self.admission.admit(priority)
        if ticket is None:
            raise ReplicaOverloaded(f"replica {self.replica_id} is overloaded ({verdict.reason}); "
                                    f"{priority.label} requests are refused until the queue drains",
                                    verdict.retry_after_s or 1.0)
        self.num_resumed += resumed
        return AdmittedRequest(request_id, ticket, resumed)

    def first_token(self, request: AdmittedRequest) -> None:
        """The request's first output token came (later calls, and calls after finished(), do
        nothing: the ticket leaves the queue once)."""
        request.ticket.first_token(sample=not request.resumed)

    def finished(self, request: AdmittedRequest) -> None:
        """The request ended for any reason (done, refused by the engine, failed, cancelled)."""
        request.ticket.done()

    # ---- reports ------------------------------------------------------------------------------

    def report_base(self) -> int | None:
        """The prefix cache's cache_seq the next routing report counts changes from (None: it will
        be a snapshot): ask the engine's stats for the block hashes since it."""
        return self.routing_reports.next_base()

    def routing_report(self, stats: EngineStats | None, include_hashes: bool = True) -> RoutingReport:
        """The report for the request routers, from engine stats taken with include_block_hashes
        and block_hashes_since=report_base(). None: the engine has stopped, and routers skip the
        replica at once. Without include_hashes (a router that does not route on prefixes) the
        cache is left out and no delta is consumed."""
        builder = self.routing_reports
        if stats is None:
            return builder.stopped(self.replica_id)
        counts = dict(num_queued=stats.num_waiting, num_running=stats.num_running,
                      num_free_kv_blocks=stats.num_free_kv_blocks, num_total_kv_blocks=stats.num_total_kv_blocks,
                      block_size=stats.block_size)
        if not include_hashes:
            return RoutingReport(self.replica_id, 0, **counts)
        return builder.build(self.replica_id, cache_seq=stats.cache_seq,
                             changes_since=lambda since: _changes_in(stats, since),
                             snapshot=lambda: _snapshot_in(stats), **counts)

    def load_report(self, stats: EngineStats) -> LoadReport:
        """The report the autoscaler scales on: the queue of admitted requests without a first
        token (size, the oldest one's age, TTFT p90 over the last ttft_window_s), running
        requests, seats and KV blocks. The engine's own TTFT percentiles cover its last N
        requests, however old: not used."""
        queue = self.admission.queue_stats()
        return LoadReport(
            num_waiting_first_token=int(queue["num_waiting_first_token"]), oldest_wait_s=queue["oldest_wait_s"],
            num_running=stats.num_running, kv_usage=stats.kv_usage, num_seats=self.num_seats,
            num_shed=self.num_shed(), num_free_kv_blocks=stats.num_free_kv_blocks,
            num_total_kv_blocks=stats.num_total_kv_blocks, ttft_p90_s=queue.get("ttft_p90_s"))

    def num_shed(self, priority: Priority | None = None) -> int:
        """Requests refused, of one priority or all, since start."""
        if priority is not None:
            return self.admission.num_shed(priority)
        return sum(self.admission.num_shed(p) for p in Priority)

    def oldest_wait_s(self) -> float:
        return self.admission.oldest_wait_s()


def _changes_in(stats: EngineStats, since: int) -> tuple[Sequence[int], Sequence[int]] | None:
    """The prefix-cache changes since `since` in the stats, or None (they hold a snapshot)."""
    if stats.block_hashes_since != since or stats.stored_block_hashes is None or stats.removed_block_hashes is None:
        return None
    return stats.stored_block_hashes, stats.removed_block_hashes


def _snapshot_in(stats: EngineStats) -> tuple[int, ...]:
    if stats.cached_block_hashes is None:
        raise RuntimeError("the engine's stats hold changes, not the snapshot the routing report needs")
    return stats.cached_block_hashes
