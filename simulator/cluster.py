"""A simulated deployment: replicas, the request router, routing reports and the autoscaler.

Every decision is made by our own code, unchanged:
- routing: router.policy (the same policy objects PrefixAwareRouter uses) over ReplicaSnapshots
  built as it builds them: load is the router's count of requests sent and not finished (Serve's
  ongoing-request count), free KV blocks come from each replica's last report, and prefix hits from
  router.prefix_index.PrefixIndex (reported hashes plus this router's own dispatches);
- reports: each replica reports every routing_stats_period_s (Serve's poll), delivered
  report_delay_s later: the router decides on reports that are that stale, as it does in Serve;
- admission: autoscaler.admission per replica, as LLMServer admits (a refusal is a 503);
- autoscaling: autoscaler.policy.decide every autoscale_period_s over the ready replicas' loads,
  the replicas it asks for becoming ready replica_start_s later (imports and weight load), and
  the ones it removes draining first (no new requests; gone when their last one ends).
Only the forward (a step-time model, simulator/step_model.py) and the clock are replaced.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from autoscaler.admission import replica_policy
from autoscaler.policy import AutoscalerConfig, AutoscalerState, decide
from contracts.priority import Priority
from loadtest.results import RequestResult
from simulator.events import EventLoop
from contracts import RoutingReport
from simulator.replica import ReplicaEvents, SimReplica, SimRequest
from loadtest.traces import BenchRequest
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.sched.hashing import hash_prompt_blocks
from router.policy import ReplicaTable, RouterConfig, make_policy
from router.prefix_index import PrefixIndex
from router.report_builder import RoutingReportBuilder

# Bytes of a report as JSON (what record_routing_stats returns, as Serve ships it): about 300 besides
# its hashes, and about 21 per hash (a 64-bit int in decimal and its separator), as
# `python -m loadtest.benchmarks.bench_report_sizes` measures on real reports (2.14 MB for 100,000 hashes).
REPORT_BASE_BYTES = 300
REPORT_BYTES_PER_HASH = 21


def scheduler_config(**limits: Any) -> SchedulerConfig:
    """A replica engine's limits: EngineConfig's defaults for the scheduling knobs, 4,096 KV blocks
    and an 8,192-token context, with `limits` (SchedulerConfig's fields) over them."""
    engine = EngineConfig()
    fields = dict(block_size=engine.block_size, num_kv_blocks=4096, max_num_seqs=engine.max_num_seqs,
                  max_num_batched_tokens=engine.max_num_batched_tokens, max_model_len=8192,
                  enable_prefix_caching=engine.enable_prefix_caching, batching=engine.batching,
                  max_decode_slowdown=engine.max_decode_slowdown)
    unknown = sorted(set(limits) - set(fields))
    if unknown:
        raise ValueError(f"unknown scheduler limits {unknown}; known: {sorted(fields)}")
    return SchedulerConfig(**{**fields, **limits})


@dataclass(slots=True)
class ClusterConfig:
    # What every replica's engine schedules under, as a served engine's scheduler does.
    scheduler: SchedulerConfig = field(default_factory=scheduler_config)
    # Replicas at the start (ready at time 0); with autoscaling, its first target.
    num_replicas: int = 1
    router: RouterConfig = field(default_factory=RouterConfig)
    dispatch_ttl_s: float = 10.0
    routing_stats_period_s: float = 1.0
    report_delay_s: float = 0.0
    # "delta": the prefix cache's changes, a snapshot every full_report_every reports (what
    # LLMServer sends); "full": every report a snapshot (the baseline deltas are compared with).
    report_mode: str = "delta"
    full_report_every: int = 60
    # The `admission` app arg (autoscaler.admission.replica_policy's keywords), as every
    # replica's ReplicaCore takes it.
    admission: dict[str, Any] = field(default_factory=dict)
    autoscaling: AutoscalerConfig | None = None
    autoscale_period_s: float = 1.0
    # Seconds from a replica being asked for to its first request: process start, imports, weights.
    replica_start_s: float = 30.0
    # Host seconds every step costs on top of the step-time model's forward: the engine loop's own
    # work between forwards (the scheduler, outputs, the caller's handling of them). 0 leaves it out.
    step_overhead_s: float = 0.0
    # Seconds a request spends on its way from the client to its replica and back besides the
    # engine (HTTP proxy, ingress, handle, streaming back): added before it is routed, so it
    # counts in TTFT and end-to-end latency but not in TPOT. 0 leaves it out (an offline engine).
    request_latency_s: float = 0.0
    # Seconds from the router to a replica (a handle's call), and from a request's end at its
    # replica back to the router (its reply; the router's count of the replica's ongoing requests
    # drops then). 0: at once. A parallel run (simulator.parallel) needs it > 0: it is the
    # window each process runs without hearing from the others.
    link_latency_s: float = 0.0
    # Per-token chunk times in the results (ITL); off at scale, where they cost memory.
    record_token_times: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("step_overhead_s", "request_latency_s", "link_latency_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.report_mode not in ("delta", "full"):
            raise ValueError(f"report_mode must be 'delta' or 'full', got {self.report_mode!r}")


@dataclass(slots=True)
class SimRun:
    results: list[RequestResult]
    duration_s: float
    # Every routing_stats_period_s: t_s, num_waiting, num_running (all replicas), replicas (ready):
    # the keys of `iterserve bench`'s timeline, so the report plots it the same way.
    timeline: list[dict[str, float]]
    # Each autoscaling decision: t_s, target, ready, starting, draining, pressure.
    decisions: list[dict[str, float]]
    counters: dict[str, float]


def reports(ready: Iterable[SimReplica], draining: Iterable[SimReplica],
            include_hashes: bool) -> tuple[int, int, list[tuple[RoutingReport, int]]]:
    """Every ready replica's routing report now, with its cached block count, and the requests
    waiting and running over the ready and draining ones."""
    ready = list(ready)
    live = ready + list(draining)
    num_waiting, num_running = sum(r.scheduler.num_waiting for r in live), sum(r.scheduler.num_running for r in live)
    made = [(replica.routing_report(include_hashes), replica.scheduler.kv.pool.num_cached_blocks) for replica in ready]
    return num_waiting, num_running, made


def make_replica(config: ClusterConfig, replica_id: str, loop: EventLoop, step_model: Any,
                 events: ReplicaEvents) -> SimReplica:
    every = 1 if config.report_mode == "full" else config.full_report_every
    if config.step_overhead_s:
        step_model = _WithOverhead(step_model, config.step_overhead_s)
    return SimReplica(replica_id, loop, config.scheduler, step_model, config.admission, events,
                      config.record_token_times, RoutingReportBuilder(full_report_every=every))


class _WithOverhead:
    """A step-time model plus a fixed host cost per step."""

    def __init__(self, model: Any, overhead_s: float) -> None:
        self.model, self.overhead_s = model, overhead_s
        self.idle_wake_s = getattr(model, "idle_wake_s", 0.0)

    def predict(self, batch: Any) -> float:
        return self.model.predict(batch) + self.overhead_s


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off while a loop runs: a run builds millions of long-lived
    objects (blocks' token tuples, the pools' change logs, the results) and almost no reference
    cycles, and the collector, tracing all of them again and again, took 77% of a 1,000-replica
    run (py-spy). Reference counting frees everything else as it always does."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class SimCluster:
    def __init__(self, config: ClusterConfig, step_model: Any) -> None:
        self.config = config
        self.step_model = step_model
        self.loop = EventLoop()
        self.rng = random.Random(config.seed)
        self.policy = make_policy(config.router, self.rng)
        self.index = PrefixIndex(config.dispatch_ttl_s)
        self.replicas: dict[str, SimReplica] = {}  # ready, taking requests
        self.draining: dict[str, SimReplica] = {}
        self.starting: dict[str, float] = {}  # replica id -> when it becomes ready
        self._every_replica: list[SimReplica] = []  # for the run's counters, removed ones too
        self._reports: dict[str, RoutingReport] = {}
        self._ongoing: dict[str, int] = defaultdict(int)
        # The ready replicas as the policy reads them (ReplicaSnapshot's figures as columns), kept
        # in step with _ongoing and _reports; rebuilt when the set of ready replicas changes.
        self._table: ReplicaTable | None = None
        self._next_replica = 0
        replica_policy(**config.admission)  # refused here, before any replica is built
        self._events = ReplicaEvents(on_done=self._replica_done)
        self._pending = 0
        self._dependents: dict[str, list[BenchRequest]] = defaultdict(list)
        self._results: list[RequestResult] = []
        self._autoscaler_state = AutoscalerState()
        self.target_replicas = config.num_replicas
        self.timeline: list[dict[str, float]] = []
        self.decisions: list[dict[str, float]] = []
        self.counters: dict[str, float] = defaultdict(float)
        for _ in range(config.num_replicas):
            self._add_replica()

    # ---- replicas ---------------------------------------------------------------------------

    def _new_id(self) -> str:
        self._next_replica += 1
        return f"r{self._next_replica:04d}"

    def _add_replica(self, replica_id: str | None = None) -> None:
        replica_id = replica_id or self._new_id()
        self.starting.pop(replica_id, None)
        replica = make_replica(self.config, replica_id, self.loop, self.step_model, self._events)
        self.replicas[replica_id] = replica
        self._table = None
        self._every_replica.append(replica)

    def _start_replica(self) -> None:
        replica_id = self._new_id()
        self.starting[replica_id] = self.loop.now + self.config.replica_start_s
        self.loop.after(self.config.replica_start_s, self._replica_ready, replica_id)

    def _replica_ready(self, replica_id: str) -> None:
        if replica_id in self.starting:  # not cancelled while it loaded
            self._add_replica(replica_id)

    def _remove_one(self) -> None:
        """Cancel a replica still starting, else drain the least loaded ready one."""
        if self.starting:
            latest = max(self.starting, key=self.starting.__getitem__)
            del self.starting[latest]
            return
        if len(self.replicas) <= 1:
            return
        replica_id = min(self.replicas, key=lambda rid: (self._ongoing[rid], rid))
        replica = self.replicas.pop(replica_id)
        self._table = None
        self.index.retain(self.replicas)
        self._reports.pop(replica_id, None)
        if replica.num_unfinished:
            self.draining[replica_id] = replica
        self.counters["replicas_removed"] += 1

    # ---- requests ---------------------------------------------------------------------------

    def _submit(self, bench: BenchRequest) -> None:
        result = RequestResult(bench.request_id, priority=bench.priority, arrival_s=self.loop.now, sent_s=self.loop.now,
                               prompt_tokens=len(bench.prompt_token_ids))
        self._results.append(result)
        priority = Priority.BATCH if bench.priority == "batch" else Priority.INTERACTIVE
        hashes = hash_prompt_blocks(bench.prompt_token_ids, self.config.scheduler.block_size) if self._routes_on_prefix else []
        request = SimRequest(bench, result, priority, hashes)
        if self.config.request_latency_s:
            self.loop.after(self.config.request_latency_s, self._dispatch, request)
        else:
            self._dispatch(request)

    def _dispatch(self, request: SimRequest) -> None:
        result = request.result
        if not self.replicas:
            result.status, result.error = 503, "no replica ready"
            self._done(request)
            return
        replica_id = self._route(request)
        request.replica_id = replica_id
        self._ongoing[replica_id] += 1
        self._set_row(replica_id)
        self._send(self.replicas[replica_id], request)

    def _send(self, replica: SimReplica, request: SimRequest) -> None:
        latency = self.config.link_latency_s
        if latency:
            self.loop.after(latency, replica.receive, request)
        else:
            replica.receive(request)

    def _replica_done(self, request: SimRequest) -> None:
        """A request's end at its replica (ok or refused), heard by the router link_latency_s later."""
        latency = self.config.link_latency_s
        if latency:
            self.loop.after(latency, self._done, request)
        else:
            self._done(request)

    @property
    def _routes_on_prefix(self) -> bool:
        return self.config.router.policy == "prefix_aware"

    def _route(self, request: SimRequest) -> str:
        """PrefixAwareRouter.choose_replicas' decision, on this cluster's state."""
        now = self.loop.now
        if self._table is None:
            self._table = ReplicaTable(list(self.replicas))
            for replica_id in self.replicas:
                self._set_row(replica_id)
        hashes = request.block_hashes
        hits = self.index.hits(hashes, now) if hashes else {}
        bench = request.bench
        blocks_needed = -(-(len(bench.prompt_token_ids) + bench.output_tokens) // self.config.scheduler.block_size)
        chosen = self.policy.choose(self._table, hits, len(hashes), blocks_needed)
        if hashes:
            self.index.record_dispatch(chosen, hashes, now)
        return chosen

    def _set_row(self, replica_id: str) -> None:
        """The replica's row of the routing table, as the real router builds its snapshot: load is
        the requests sent and not finished; free and total KV blocks are the last report's (0, 0
        before the first: capacity unknown, as the real router assumes)."""
        table = self._table
        row = table.position.get(replica_id) if table is not None else None
        if row is None:
            return
        table.load[row] = self._ongoing[replica_id]
        report = self._reports.get(replica_id)
        if report is not None:
            table.free[row], table.total[row] = report.num_free_kv_blocks, report.num_total_kv_blocks

    def _done(self, request: SimRequest) -> None:
        if request.replica_id is not None:
            self._ongoing[request.replica_id] -= 1
            self._set_row(request.replica_id)
            draining = self.draining.get(request.replica_id)
            if draining is not None and not draining.num_unfinished:
                del self.draining[request.replica_id]
        self._pending -= 1
        if self._pending <= 0:
            self.loop.stop()
        for follower in self._dependents.pop(request.bench.request_id, ()):
            self.loop.after(follower.arrival_s, self._submit, follower)

    # ---- periodic work ----------------------------------------------------------------------

    def _report_all(self) -> None:
        self._record_reports(self.loop.now, *reports(self.replicas.values(), self.draining.values(),
                                                     self._routes_on_prefix))
        if self._pending:
            self.loop.after(self.config.routing_stats_period_s, self._report_all)

    def _record_reports(self, time_s: float, num_waiting: int, num_running: int,
                        made: list[tuple[RoutingReport, int]]) -> None:
        """The reports made at time_s (with the replicas' cached block counts), and the load they
        saw: counted, put on the timeline, and delivered report_delay_s later."""
        delay = self.config.report_delay_s
        counters = self.counters
        self.timeline.append({"t_s": time_s, "replicas": len(self.replicas), "num_waiting": num_waiting,
                              "num_running": num_running})
        for report, num_cached_blocks in made:
            counters["reports"] += 1
            counters["report_bytes"] += REPORT_BASE_BYTES + REPORT_BYTES_PER_HASH * report.num_hashes
            counters["report_hashes"] += report.num_hashes
            if self._routes_on_prefix:  # what the same report would cost as a snapshot: the baseline
                counters["snapshot_bytes"] += REPORT_BASE_BYTES + REPORT_BYTES_PER_HASH * num_cached_blocks
            if delay:
                self.loop.at(time_s + delay, self._deliver, report)
            else:
                self._deliver(report)

    def _deliver(self, report: RoutingReport) -> None:
        if report.replica_id not in self.replicas:
            return
        self._reports[report.replica_id] = report
        self._set_row(report.replica_id)
        if self._routes_on_prefix:
            self.index.apply_report(report.replica_id, report, self.loop.now)

    def _autoscale(self) -> None:
        config = self.config.autoscaling
        loads = [replica.load_report() for replica in self.replicas.values()]
        decision = decide(loads, self.target_replicas, self.loop.now, config, self._autoscaler_state)
        self._autoscaler_state = decision.state
        self.target_replicas = decision.num_replicas
        while len(self.replicas) + len(self.starting) < self.target_replicas:
            self._start_replica()
        while len(self.replicas) + len(self.starting) > self.target_replicas and (self.starting or len(self.replicas) > 1):
            self._remove_one()
        self.decisions.append({"t_s": self.loop.now, "target": self.target_replicas, "ready": len(self.replicas),
                              "starting": len(self.starting), "draining": len(self.draining),
                              "pressure": decision.pressure})
        if self._pending:
            self.loop.after(self.config.autoscale_period_s, self._autoscale)

    # ---- the run ----------------------------------------------------------------------------

    def run(self, workload: list[BenchRequest], max_duration_s: float = math.inf) -> SimRun:
        """Every request of the workload through the cluster; requests still open at
        max_duration_s are reported unfinished (status 0), as the HTTP client cuts a run off."""
        self._load(workload)
        self.loop.at(0.0, self._report_all)
        if self.config.autoscaling is not None:
            self.loop.at(0.0, self._autoscale)
        with collector_off():
            if self._pending > 0:
                self.loop.run(until_s=max_duration_s)  # _done stops it after the last request
        return self._collect(workload, [r.counters for r in self._every_replica], self.loop.num_events)

    def _load(self, workload: list[BenchRequest]) -> None:
        self._pending = len(workload)
        for bench in workload:
            if bench.after_id is not None:
                self._dependents[bench.after_id].append(bench)
        self.loop.feed(((bench.arrival_s, bench) for bench in workload if bench.after_id is None), self._submit)

    def _collect(self, workload: list[BenchRequest], replica_counters: list[Any], num_events: int) -> SimRun:
        counters = dict(self.counters)
        for name in ("steps", "busy_s", "tokens", "preemptions", "refused", "prompt_tokens", "cached_tokens"):
            counters[name] = counters.get(name, 0.0) + sum(getattr(c, name) for c in replica_counters)
        counters["events"] = num_events
        by_id = {r.request_id: r for r in self._results}
        results = [by_id.get(b.request_id) or RequestResult(b.request_id, priority=b.priority, arrival_s=b.arrival_s)
                   for b in workload]
        return SimRun(results=results, duration_s=self.loop.now, timeline=self.timeline, decisions=self.decisions,
                      counters=counters)
