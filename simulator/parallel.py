"""SimCluster with its replicas in worker processes: the same results in less wall time.

A replica depends on the rest of the cluster only through what crosses the link: a request the
router dispatches reaches it link_latency_s later (ClusterConfig.link_latency_s), the router hears
of a request's end link_latency_s after it, and a routing report reaches the router report_delay_s
(at least link_latency_s) after it was made. So time cuts into windows of link_latency_s, and in
window k the router (this process) and each shard of replicas (a worker process) run at once,
each on what the others did up to window k-1:

    router, window k: arrivals; the ends and reports the shards made in window k-1
    shard, window k:  the requests the router dispatched in window k-1; its replicas' steps

Neither reads what the other writes in the same window, so each runs the events SimCluster runs
with the same config in one process, in the same order, and every request's timings come out the
same (tests/unit/simulator/test_parallel.py); only the event count differs (a shard has its own report
event). Events at exactly equal times on different replicas could in principle run in another
order than in one process; the test's runs have none. A fixed replica count only: the autoscaler
reads every replica's load at one instant, which a window does not have.
"""

from __future__ import annotations

import math
import multiprocessing
import traceback
from dataclasses import dataclass
from typing import Any

from simulator.cluster import ClusterConfig, SimCluster, SimRun, collector_off, make_replica, reports
from simulator.events import EventLoop
from simulator.replica import ReplicaEvents, SimRequest
from loadtest.traces import BenchRequest

# Seconds a worker may take to answer one window before the run is called hung.
WINDOW_TIMEOUT_S = 600.0


@dataclass(slots=True)
class _Remote:
    """The router's handle on a replica in a worker process."""

    replica_id: str
    shard: int


class Shard:
    """Some of the cluster's replicas on an event loop of their own, run a window at a time."""

    def __init__(self, config: ClusterConfig, step_model: Any, replica_ids: list[str]) -> None:
        self.config = config
        self.loop = EventLoop()
        self._ended: list[tuple[float, SimRequest]] = []
        self._made: list[tuple[float, int, int, list]] = []
        self._include_hashes = config.router.policy == "prefix_aware"
        events = ReplicaEvents(on_done=self._on_done)
        self.replicas = {rid: make_replica(config, rid, self.loop, step_model, events) for rid in replica_ids}
        self.loop.at(0.0, self._report)

    def _on_done(self, request: SimRequest) -> None:
        self._ended.append((self.loop.now, request))

    def _report(self) -> None:
        self._made.append((self.loop.now, *reports(self.replicas.values(), (), self._include_hashes)))
        self.loop.after(self.config.routing_stats_period_s, self._report)

    def window(self, dispatches: list[tuple[float, str, SimRequest]], end_s: float) -> tuple[list, list]:
        """Take the router's dispatches, run every event before end_s; return the requests that
        ended (time, request) and the reports made (time, waiting, running, [(report, cached)])."""
        for time_s, replica_id, request in dispatches:
            self.loop.at(time_s, self.replicas[replica_id].receive, request)
        self.loop.run(until_s=math.nextafter(end_s, -math.inf))
        ended, self._ended = self._ended, []
        made, self._made = self._made, []
        return ended, made


def _ended_fields(time_s: float, request: SimRequest) -> tuple:
    r = request.result
    return (time_s, request.bench.request_id, r.status, r.error, r.first_token_s, r.finish_s, r.output_tokens,
            r.chunk_times_s)


def _shard_main(conn: Any, config: ClusterConfig, step_model: Any, replica_ids: list[str]) -> None:
    """A worker process: ("window", dispatches, end_s) -> ("window", ended, made) until ("stop",),
    answered by ("stop", {replica_id: counters}, events). An error is answered ("error", text)."""
    try:
        shard = Shard(config, step_model, replica_ids)
        with collector_off():
            while True:
                message = conn.recv()
                if message[0] == "stop":
                    conn.send(("stop", {rid: r.counters for rid, r in shard.replicas.items()}, shard.loop.num_events))
                    return
                ended, made = shard.window(message[1], message[2])
                conn.send(("window", [_ended_fields(t, request) for t, request in ended], made))
    except BaseException:  # noqa: BLE001 - the parent raises it with this text
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class ParallelCluster(SimCluster):
    """The router here, the replicas in `workers` processes (replica i in shard i % workers)."""

    def __init__(self, config: ClusterConfig, step_model: Any, workers: int = 2) -> None:
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if not config.link_latency_s > 0:
            raise ValueError("a parallel run needs link_latency_s > 0: it is the window the processes run apart")
        if not config.report_delay_s >= config.link_latency_s:
            raise ValueError(f"a parallel run needs report_delay_s >= link_latency_s ({config.link_latency_s}), "
                             f"got {config.report_delay_s}")
        if config.autoscaling is not None:
            raise ValueError("a parallel run has a fixed replica count: autoscaling needs one process")
        self.workers = workers
        self._order: list[str] = []
        self._position: dict[str, int] = {}  # replica id -> its index in _order (the report order)
        self._outbox: list[list[tuple[float, str, SimRequest]]] = [[] for _ in range(workers)]
        self._sent: dict[str, SimRequest] = {}
        super().__init__(config, step_model)

    def _add_replica(self, replica_id: str | None = None) -> None:
        replica_id = replica_id or self._new_id()
        self.replicas[replica_id] = _Remote(replica_id, len(self._order) % self.workers)  # type: ignore[assignment]
        self._position[replica_id] = len(self._order)
        self._order.append(replica_id)
        self._table = None

    def _send(self, replica: Any, request: SimRequest) -> None:
        self._outbox[replica.shard].append((self.loop.now + self.config.link_latency_s, replica.replica_id, request))
        self._sent[request.bench.request_id] = request

    def _remote_done(self, fields: tuple) -> None:
        request = self._sent.pop(fields[1])
        r = request.result
        r.status, r.error, r.first_token_s, r.finish_s, r.output_tokens, r.chunk_times_s = fields[2:]
        self._done(request)

    def _take(self, answers: list[tuple], until_s: float = math.inf) -> None:
        """The shards' answers for one window: ends heard link_latency_s later, reports (made
        before until_s) recorded in replica order."""
        latency = self.config.link_latency_s
        ended = sorted((f for answer in answers for f in answer[1]), key=lambda f: f[0])
        for fields in ended:
            self.loop.at(fields[0] + latency, self._remote_done, fields)
        position = self._position
        for made in zip(*(answer[2] for answer in answers)):  # each shard reports at the same times
            time_s = made[0][0]
            if time_s >= until_s:
                break
            reports_made = sorted((m for shard in made for m in shard[3]), key=lambda m: position[m[0].replica_id])
            self._record_reports(time_s, sum(shard[1] for shard in made), sum(shard[2] for shard in made), reports_made)

    def run(self, workload: list[BenchRequest], max_duration_s: float = math.inf) -> SimRun:
        if max_duration_s != math.inf:
            raise ValueError("a parallel run goes to the last request: max_duration_s is for SimCluster")
        self._load(workload)
        context = multiprocessing.get_context("spawn")
        conns, processes = [], []
        try:
            for shard in range(self.workers):
                parent, child = context.Pipe()
                ids = self._order[shard::self.workers]
                process = context.Process(target=_shard_main, args=(child, self.config, self.step_model, ids),
                                          daemon=True, name=f"sim-shard-{shard}")
                process.start()
                child.close()
                conns.append(parent)
                processes.append(process)
            with collector_off():
                counters, events = self._windows(conns)
        finally:
            for conn in conns:
                conn.close()
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
        return self._collect(workload, [counters[rid] for rid in self._order], self.loop.num_events + events)

    def _windows(self, conns: list[Any]) -> tuple[dict[str, Any], int]:
        latency = self.config.link_latency_s
        end_s = latency
        for conn in conns:
            _post(conn, ("window", [], end_s))
        first = True
        while self._pending > 0:  # each shard owes one answer here: the window it was last sent
            if not first:
                self._take([_receive(conn, "window") for conn in conns])
            first = False
            self.loop.run(until_s=math.nextafter(end_s, -math.inf))  # _done stops it after the last request
            if self._pending <= 0:
                break
            outbox, self._outbox = self._outbox, [[] for _ in conns]
            end_s += latency
            for conn, dispatches in zip(conns, outbox):
                _post(conn, ("window", dispatches, end_s))
        # The shards' last window: the reports they made before the last request ended.
        self._take([_receive(conn, "window") for conn in conns], until_s=self.loop.now)
        counters: dict[str, Any] = {}
        events = 0
        for conn in conns:
            _post(conn, ("stop",))
            answer = _receive(conn, "stop")
            counters.update(answer[1])
            events += answer[2]
        return counters, events


def _post(conn: Any, message: tuple) -> None:
    """Send to a worker; one that has gone is asked for its last word (its error, if it sent one)."""
    try:
        conn.send(message)
    except OSError:
        _receive(conn, "nothing: it is gone")
        raise


def _receive(conn: Any, kind: str) -> tuple:
    try:
        if not conn.poll(WINDOW_TIMEOUT_S):
            raise RuntimeError(f"a simulator worker sent nothing for {WINDOW_TIMEOUT_S:.0f} s")
        answer = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError("a simulator worker ended without an answer") from None
    if answer[0] == "error":
        raise RuntimeError(f"a simulator worker failed:\n{answer[1]}")
    if answer[0] != kind:
        raise RuntimeError(f"a simulator worker answered {answer[0]!r}, expected {kind!r}")
    return answer
