"""One simulated LLMServer replica: the real engine and the real replica core, with the model
forward and the clock replaced.

- The engine is our LLMEngine (its scheduler, block pool and prefix cache, its step phases and
  counters) over a SimulatedRunner: a step's duration is what the step-time model predicts for
  the batch (simulator/step_model.py), and every sampled token is the same id (requests ignore
  EOS and end at their length, as in every benchmark here). A step is the engine's own phases
  with simulated time between them: schedule(), then, the predicted duration later,
  execute_and_update() and take_finished().
- What the replica decides and reports (admission, each request's first token and end, the
  routing and load reports) is ReplicaCore (deployments/replica_core.py), the class LLMServer
  runs for Serve, on the simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoscaler.policy import ReplicaLoad
from contracts import RoutingReport
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from deployments.replica_core import AdmittedRequest, ReplicaCore, ReplicaOverloaded
from loadtest.results import RequestResult
from loadtest.traces import BenchRequest
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine.llm_engine import LLMEngine
from model_worker.sched.batch import SchedulerOutput
from model_worker.sched.request import Request
from model_worker.sched.request_checks import RequestRejected
from router.report_builder import RoutingReportBuilder
from simulator.events import EventLoop

# The token every simulated step samples: any id works, since requests ignore EOS.
SAMPLED_TOKEN = 1


class SimulatedRunner:
    """The engine's ModelRunner with the forward replaced: no tensors, no model. The replica asks
    step_time_s(batch, after_idle) for how long a step takes; execute() returns SAMPLED_TOKEN for every
    sequence that samples."""

    tokenizer = None
    # Any token id is accepted.
    vocab_size = None
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, limits: SchedulerConfig, step_model: Any) -> None:
        self.num_kv_blocks = limits.num_kv_blocks
        self.max_model_len = limits.max_model_len
        self.step_model = step_model
        # What the first step after an idle spell costs beyond its shape (a model may leave it out).
        self.idle_wake_s = float(getattr(step_model, "idle_wake_s", 0.0))
        # Simulated seconds of the steps predicted so far.
        self.forward_time_s = 0.0
        self.execute_time_s = 0.0
        self.load_times_s: dict[str, float] = {}
        self.sampled_logprobs: dict[str, tuple[float, list[int], list[float]]] = {}
        self.prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[int], list[float]]]]] = {}
        # Steps take no wall time here: no heartbeat inside one (model_worker/engine/engine_loop.py).
        self.progress = 0

    def step_time_s(self, batch: SchedulerOutput, after_idle: bool = False) -> float:
        duration_s = self.step_model.predict(batch) + (self.idle_wake_s if after_idle else 0.0)
        self.forward_time_s += duration_s
        self.execute_time_s += duration_s
        return duration_s

    def execute(self, batch: SchedulerOutput) -> list[int]:
        return [SAMPLED_TOKEN] * batch.num_sampling


def engine_config(limits: SchedulerConfig) -> EngineConfig:
    """The EngineConfig whose engine, over a runner with limits' KV blocks and context, schedules
    under exactly `limits`."""
    return EngineConfig(block_size=limits.block_size, max_num_seqs=limits.max_num_seqs,
                        max_num_batched_tokens=limits.max_num_batched_tokens,
                        enable_prefix_caching=limits.enable_prefix_caching, batching=limits.batching,
                        max_decode_slowdown=limits.max_decode_slowdown)


@dataclass(slots=True)
class SimRequest:
    bench: BenchRequest
    result: RequestResult
    priority: Priority
    block_hashes: list[int]
    replica_id: str | None = None
    admitted: AdmittedRequest | None = None


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
    def __init__(self, replica_id: str, loop: EventLoop, limits: SchedulerConfig, step_model: Any,
                 admission: dict[str, Any], events: ReplicaEvents, record_token_times: bool = True,
                 report_builder: RoutingReportBuilder | None = None) -> None:
        self.replica_id = replica_id
        self.loop = loop
        self.runner = SimulatedRunner(limits, step_model)
        self.engine = LLMEngine(engine_config(limits), model_runner=self.runner, clock=loop.clock, detokenize=False)
        if self.engine.scheduler.config != limits:
            raise ValueError(f"the simulated engine schedules under {self.engine.scheduler.config}, not {limits}")
        self.core = ReplicaCore(replica_id, limits, loop.clock, admission=admission, report_builder=report_builder)
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

    @property
    def scheduler(self) -> Any:
        return self.engine.scheduler

    # ---- requests -------------------------------------------------------------------------

    def receive(self, request: SimRequest) -> None:
        """A routed request: admitted (queued in the engine) or refused (status 503; LLMServer's
        refusal is a 429, which the ingress retries on another replica)."""
        bench = request.bench
        try:
            admitted = self.core.admit(bench.request_id, request.priority)
        except ReplicaOverloaded as refusal:
            self.counters.refused += 1
            self._end(request, 503, f"overloaded: {refusal}")
            return
        request.admitted = admitted
        params = self._params.get(bench.output_tokens)
        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=bench.output_tokens, ignore_eos=True)
            self._params[bench.output_tokens] = params
        try:
            # The path the engine process takes after AsyncLLMEngine's checks: a generated
            # workload needs no tokenizing, and the ingress's block hashes are used as sent.
            engine_request = self.engine.add_checked_request(
                bench.request_id, list(bench.prompt_token_ids), params, request.priority, self.loop.now,
                None, [], list(request.block_hashes))
        except RequestRejected as refusal:
            self.core.finished(admitted)
            self._end(request, 400, str(refusal))
            return
        self._requests[bench.request_id] = request
        self._awaiting_first[bench.request_id] = engine_request
        if not self.stepping:
            self._step(after_idle=True)

    def _end(self, request: SimRequest, status: int, error: str) -> None:
        request.result.status = status
        request.result.error = error
        self.events.on_done(request)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- the step loop ----------------------------------------------------------------------

    def _step(self, after_idle: bool = False) -> None:
        batch = self.engine.schedule()
        if batch.is_empty:
            self.stepping = False
            return
        self.stepping = True
        duration_s = self.runner.step_time_s(batch, after_idle)
        self.counters.busy_s += duration_s
        self.loop.after(duration_s, self._step_done, batch)

    def _step_done(self, batch: SchedulerOutput) -> None:
        update = self.engine.execute_and_update(batch)
        progressed = update.progressed
        counters = self.counters
        counters.steps += 1
        counters.tokens += len(progressed)
        now = self.loop.now
        if update.failed:  # the simulated runner never raises: a failure here is the simulator's own bug
            raise RuntimeError(f"simulated steps cannot fail, yet {sorted(update.failed)} did")
        # First tokens: a pass over the few requests still waiting for one, not over every token.
        firsts = [request for request in self._awaiting_first.values() if request.timings.first_token_s is not None]
        for request in firsts:
            del self._awaiting_first[request.request_id]
            sim = self._requests[request.request_id]
            sim.result.first_token_s = now
            counters.prompt_tokens += request.num_prompt_tokens
            counters.cached_tokens += max(request.num_cached_tokens, 0)
            self.core.first_token(sim.admitted)
        if self.record_token_times:
            requests = self._requests
            for request in progressed:
                requests[request.request_id].result.chunk_times_s.append(now)
        for request in self.engine.take_finished():
            sim = self._requests.pop(request.request_id)
            result = sim.result
            result.status, result.finish_s = 200, now
            result.output_tokens = request.num_output_tokens
            counters.preemptions += request.num_preemptions
            self.core.finished(sim.admitted)
            self.events.on_done(sim)
        self._step()

    # ---- reports ----------------------------------------------------------------------------

    def routing_report(self, include_hashes: bool = True) -> RoutingReport:
        """What LLMServer.record_routing_stats reports: the same ReplicaCore over this engine's
        stats, taken as LLMServer takes them. Without include_hashes (a router that does not route
        on prefixes) the cache is left out."""
        since = self.core.report_base() if include_hashes else None
        stats = self.engine.stats(include_block_hashes=include_hashes, block_hashes_since=since)
        return self.core.routing_report(stats, include_hashes)

    def load_report(self) -> ReplicaLoad:
        """What LLMServer.record_autoscaling_stats reports, as the autoscaling policy reads it."""
        return ReplicaLoad.of(self.replica_id, self.core.load_report(self.engine.stats()))
