"""One simulated LLMServer replica: our real Scheduler (with its block pool and prefix cache) and
our real per-replica admission, with the model forward replaced by a step-time model.

The step loop is the engine's (model_worker/engine/llm_engine.py, LLMEngine.step): schedule, run, update,
take the finished ones. "Run" is a wait of predict(batch) simulated seconds, and every sampled
token is the same id (requests ignore EOS and end at their length, as in every benchmark here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoscaler.admission import AdmissionController, AdmissionPolicy, Ticket
from autoscaler.policy import ReplicaLoad
from contracts import RoutingReport
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import RequestTimings
from loadtest.results import RequestResult
from simulator.events import EventLoop
from loadtest.traces import BenchRequest
from model_worker.sched.batch import SchedulerOutput
from model_worker.config import SchedulerConfig
from model_worker.sched.request import Request
from model_worker.sched.selector import make_scheduler
from router.report_builder import RoutingReportBuilder

# The token every simulated step samples: any id works, since requests ignore EOS.
SAMPLED_TOKEN = 1


@dataclass(slots=True)
class SimRequest:
    bench: BenchRequest
    result: RequestResult
    priority: Priority
    block_hashes: list[int]
    replica_id: str | None = None
    ticket: Ticket | None = None


@dataclass(slots=True)
class ReplicaCounters:
    steps: int = 0
    busy_s: float = 0.0
    tokens: int = 0
    preemptions: int = 0
    refused: int = 0
    # Prompt tokens asked for and served from the prefix cache, at first admission.
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class ReplicaEvents:
    """What a replica tells the cluster: a request's end (ok or refused)."""

    on_done: Callable[[SimRequest], None]


class SimReplica:
    def __init__(self, replica_id: str, loop: EventLoop, scheduler_config: SchedulerConfig, step_model: Any,
                 admission_policy: AdmissionPolicy, events: ReplicaEvents, record_token_times: bool = True,
                 report_builder: RoutingReportBuilder | None = None) -> None:
        self.replica_id = replica_id
        self.loop = loop
        self.config = scheduler_config
        self.scheduler = make_scheduler(scheduler_config, eos_token_ids=(), clock=loop.clock)
        self.step_model = step_model
        self.admission = AdmissionController(admission_policy, loop.clock)
        self.events = events
        self.record_token_times = record_token_times
        self.counters = ReplicaCounters()
        self.stepping = False
        self._requests: dict[str, SimRequest] = {}
        # Requests admitted and without a first token yet (their Request, to read its timings).
        self._awaiting_first: dict[str, Request] = {}
        # One SamplingParams per output length: the scheduler only reads them, and building one
        # (it checks every field) is a good part of a simulated request's cost at 1,000,000.
        self._params: dict[int, SamplingParams] = {}
        # LLMServer's builder: deltas of the prefix cache, a snapshot now and then.
        self.report_builder = report_builder or RoutingReportBuilder()

    # ---- requests -------------------------------------------------------------------------

    def receive(self, request: SimRequest) -> None:
        """A routed request: admitted (queued in the scheduler) or refused with a 503, as
        LLMServer.generate does."""
        verdict, ticket = self.admission.admit(request.priority)
        if ticket is None:
            self.counters.refused += 1
            request.result.status = 503
            request.result.error = f"overloaded: {verdict.reason}"
            self.events.on_done(request)
            return
        request.ticket = ticket
        bench = request.bench
        params = self._params.get(bench.output_tokens)
        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=bench.output_tokens, ignore_eos=True)
            self._params[bench.output_tokens] = params
        engine_request = Request(request_id=bench.request_id, prompt_token_ids=list(bench.prompt_token_ids),
                                 sampling_params=params, priority=request.priority,
                                 timings=RequestTimings(arrival_s=self.loop.now),
                                 # The ingress's hashes, used as sent, as LLMEngine.add_request does.
                                 block_hashes=list(request.block_hashes))
        self.scheduler.add_request(engine_request)
        self._requests[bench.request_id] = request
        self._awaiting_first[bench.request_id] = engine_request
        if not self.stepping:
            self._step()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- the step loop ----------------------------------------------------------------------

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.stepping = False
            return
        self.stepping = True
        duration_s = self.step_model.predict(batch)
        self.counters.busy_s += duration_s
        self.loop.after(duration_s, self._step_done, batch)

    def _step_done(self, batch: SchedulerOutput) -> None:
        scheduler = self.scheduler
        progressed = scheduler.update(batch, [SAMPLED_TOKEN] * batch.num_sampling)
        counters = self.counters
        counters.steps += 1
        counters.tokens += len(progressed)
        now = self.loop.now
        # First tokens: a pass over the few requests still waiting for one, not over every token.
        firsts = [request for request in self._awaiting_first.values() if request.timings.first_token_s is not None]
        for request in firsts:
            del self._awaiting_first[request.request_id]
            sim = self._requests[request.request_id]
            sim.result.first_token_s = now
            counters.prompt_tokens += request.num_prompt_tokens
            counters.cached_tokens += max(request.num_cached_tokens, 0)
            if sim.ticket is not None:
                sim.ticket.first_token()
        if self.record_token_times:
            requests = self._requests
            for request in progressed:
                requests[request.request_id].result.chunk_times_s.append(now)
        for request in scheduler.take_finished():
            sim = self._requests.pop(request.request_id)
            result = sim.result
            result.status, result.finish_s = 200, now
            result.output_tokens = request.num_output_tokens
            counters.preemptions += request.num_preemptions
            if sim.ticket is not None:
                sim.ticket.done()
            self.events.on_done(sim)
        self._step()

    # ---- reports ----------------------------------------------------------------------------

    def routing_report(self, include_hashes: bool = True) -> RoutingReport:
        """What LLMServer.record_routing_stats reports, built by the same RoutingReportBuilder over
        this replica's real block pool: load, free KV blocks and the prefix cache's changes (or,
        now and then, every hash it holds). Without include_hashes (a router that does not route
        on prefixes) the cache is left out."""
        scheduler, kv = self.scheduler, self.scheduler.kv
        counts = dict(num_queued=scheduler.num_waiting, num_running=scheduler.num_running,
                      num_free_kv_blocks=kv.num_free_blocks, num_total_kv_blocks=self.config.num_kv_blocks,
                      block_size=self.config.block_size)
        if not include_hashes:
            return RoutingReport(self.replica_id, 0, **counts)
        pool = kv.pool
        return self.report_builder.build(self.replica_id, cache_seq=pool.cache_seq, changes_since=pool.changes_since,
                                         snapshot=pool.cached_hashes, **counts)

    def load_report(self) -> ReplicaLoad:
        """What LLMServer.record_autoscaling_stats reports to the autoscaling policy."""
        queue = self.admission.queue_stats()
        return ReplicaLoad(replica_id=self.replica_id, num_waiting_first_token=int(queue["num_waiting_first_token"]),
                           num_running=self.scheduler.num_running, ttft_p90_s=queue.get("ttft_p90_s"),
                           oldest_wait_s=queue["oldest_wait_s"], kv_usage=self.scheduler.kv.usage,
                           num_seats=self.config.max_num_seqs)
