"""LLMServer: one AsyncLLMEngine per replica, behind the methods the ingress and handles call.

A plain class: `deployments.app` makes it a Serve deployment, tests build it directly over a fake
model runner. What a replica decides and reports (admission, each request's first token and end,
the routing and load reports) is its ReplicaCore (deployments/replica_core.py), which the cluster
simulator's replicas run too; this class is the asynchronous side around it: the streams and
their chunk budget, keep-alives, health, per-replica latency histograms, and the conversion
between the wire types (GenerateRequest, GenerationChunk, APIError) and the engine's. A replica
refuses new work with a 429 once too many admitted requests still wait for their first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from autoscaler.admission import REPLICA_TTFT_WINDOW_S
from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from contracts.sampling import SamplingParams, SamplingParamsError
from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo, whole_response
from deployments.errors import APIError, internal, invalid, not_ready, overloaded, rejected
from deployments.metrics import (E2E_BUCKETS_S, ITL_BUCKETS_S, QUEUE_BUCKETS_S, TTFT_BUCKETS_S, FiniteHistogram,
                                 ReplicaMetrics, by_label, collect_families)
from deployments.replica_core import AdmittedRequest, ReplicaCore, ReplicaOverloaded
from deployments.token_channel import TokenChannelSender
from model_worker.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailed, RequestStream
from model_worker.config import EngineConfig
from model_worker.checkpoints.models import served_name
from model_worker.sched.scheduler import RequestRejected

# A stream with no output for this long gets a keep-alive chunk, so the ingress can tell a request
# that waits (queued, or a long prefill) from a replica that is frozen or gone.
KEEPALIVE_INTERVAL_S = 1.0
# Keep-alives stop once the engine loop has given no sign of life for this long: a step that hangs
# (a stuck kernel) must look like a dead replica to the ingress, which then migrates its streams.
# A step that runs long but moves is not one: its loop beats every engine_loop.HEARTBEAT_S while
# the model finishes layers. A step is not bounded by this: SmolLM2's full token budget of prompts
# (2,048) took 5-6 s in float32 on a 2-core AVX2 CPU, served, and with no heartbeat the keep-alives
# stopped and 41 of 64 requests sent at once failed over and failed (docs/benchmarks.md,
# eighteenth pass).
ENGINE_STALL_S = 5.0
# check_health fails once the engine loop has given no sign of life for this long, and Serve
# replaces the replica. Longer than ENGINE_STALL_S: the streams have been migrated by then, and
# a replica is only killed for a hang, never for one slow step.
ENGINE_HUNG_S = 30.0
# Chunks per second one replica streams over all its requests. Each chunk costs every hop a Ray
# message or an SSE event: about a millisecond of CPU over the replica, the ingress, the HTTP proxy
# and the client together, on the CPU machines of docs/benchmarks.md, so a token per chunk, with
# many streams and a fast step, spends more CPU on the path than the engine spends on the step, and
# where the engine shares the cores that CPU is taken from its step. Within the budget every token
# goes out as it comes; beyond it a request's tokens go out together, at most every
# num_open_streams / budget seconds. A first token and a last chunk are never held back, so TTFT
# and end-to-end latency (and TPOT) are the engine's; only the spacing of the text in between
# coarsens under load (SGLang's --stream-interval, in time instead of tokens). 50 rather than 200:
# on two cores, 16 streams served at 298 against 241 tok/s and one request at 1 req/s got its
# tokens 30 against 34 ms apart (docs/benchmarks.md, 'Speed on the CPU against vLLM, third pass').
STREAM_CHUNKS_PER_S = 50.0
# Past the budget, still no stream waits longer than this between two chunks: with more than
# budget x this many streams open, the replica sends more than its budget rather than let each
# stream's text arrive in ever larger clumps (64 streams on the budget alone: one chunk of ~7
# tokens every 1.28 s each). On two cores, 64 streams at once, no cap against this one: ITL p50
# 1,300 against 502 ms, 229 against 216 tok/s (docs/benchmarks.md, eleventh pass).
MAX_STREAM_INTERVAL_S = 0.5


class LLMServer:
    def __init__(self, model: str | None = None, engine_args: dict[str, Any] | None = None, *,
                 served_model_name: str | None = None, admission: dict[str, Any] | None = None,
                 engine: AsyncLLMEngine | None = None, replica_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic, ttft_window_s: float = REPLICA_TTFT_WINDOW_S,
                 keepalive_interval_s: float = KEEPALIVE_INTERVAL_S, engine_stall_s: float = ENGINE_STALL_S,
                 engine_hung_s: float = ENGINE_HUNG_S, stream_chunks_per_s: float = STREAM_CHUNKS_PER_S,
                 max_stream_interval_s: float = MAX_STREAM_INTERVAL_S,
                 node_id: Callable[[], str | None] = lambda: None) -> None:
        """`node_id`: the Ray node this replica runs on (None: unknown), so that it sends over the
        token channel of a caller on the same node."""
        for name, value in (("stream_chunks_per_s", stream_chunks_per_s),
                            ("max_stream_interval_s", max_stream_interval_s)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")
        # Seconds from here until the engine could serve, by part (weights, tokenizer, kv_cache)
        # and in total: what a new replica costs before it takes traffic.
        started_s = time.perf_counter()
        if engine is None:
            engine = AsyncLLMEngine(_engine_config(model, engine_args))
        self.load_times_s = {**engine.load_times_s, "total": time.perf_counter() - started_s}
        self.engine = engine
        self.replica_id = replica_id or uuid.uuid4().hex[:8]
        self.clock = clock
        # The `admission` app arg: max_waiting_requests, batch_shed_fraction, retry_after_s.
        self.core = ReplicaCore(self.replica_id, engine.limits, clock, admission=admission,
                                ttft_window_s=ttft_window_s)
        self.info = ModelInfo(
            served_model_name=served_model_name or served_name(model),
            max_model_len=self.core.max_request_tokens,
            block_size=engine.limits.block_size,
            vocab_size=engine.vocab_size,
            eos_token_ids=list(engine.eos_token_ids),
            created=int(time.time()),
        )
        # One report at a time, each built against the ones before it (the controller starts a new
        # call when one times out, while the old one may still be running).
        self._routing_report_lock = asyncio.Lock()
        self.keepalive_interval_s = keepalive_interval_s
        self.engine_stall_s = engine_stall_s
        self.engine_hung_s = engine_hung_s
        self.stream_chunks_per_s = float(stream_chunks_per_s)
        self.max_stream_interval_s = float(max_stream_interval_s)
        self.num_open_streams = 0
        self.token_channels = TokenChannelSender(node_id)
        # This replica's own registry, never prometheus_client's global one: several replicas (and
        # tests) can share a process.
        self.metrics_registry = CollectorRegistry()
        self.ttft_s = FiniteHistogram("iterserve_time_to_first_token_seconds",
                                      "Time from arrival at the engine to the first output token.",
                                      buckets=TTFT_BUCKETS_S, registry=self.metrics_registry)
        self.itl_s = FiniteHistogram("iterserve_inter_token_latency_seconds",
                                     "Time between two consecutive output tokens of a request.",
                                     buckets=ITL_BUCKETS_S, registry=self.metrics_registry)
        self.e2e_s = FiniteHistogram("iterserve_e2e_request_latency_seconds",
                                     "Time from arrival at the engine to the last output token.",
                                     buckets=E2E_BUCKETS_S, registry=self.metrics_registry)
        self.queue_s = FiniteHistogram("iterserve_request_queue_time_seconds",
                                       "Time from arrival at the engine to first being scheduled.",
                                       buckets=QUEUE_BUCKETS_S, registry=self.metrics_registry)

    # ---- generation ---------------------------------------------------------------------------

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """Stream a request. The first chunk (no tokens) confirms admission: every error a request
        can cause is raised before it, as an APIError. Closing the stream early aborts the request.
        While no output comes, a keep-alive chunk goes out every keepalive_interval_s for as long
        as the engine loop is working.

        When the request names a token channel on this replica's node (and it answers), every chunk
        after the admission chunk goes over it, and this stream ends, empty, after the last one
        (deployments/token_channel.py).

        Outputs go out as they come while this replica streams fewer than stream_chunks_per_s
        chunks a second; beyond that budget a request's outputs are folded together (`extend`)
        and sent at most every num_open_streams / stream_chunks_per_s seconds (at most
        max_stream_interval_s), the first token and the last chunk at once (STREAM_CHUNKS_PER_S
        says why)."""
        admitted, stream = self._admit(request)
        self.num_open_streams += 1
        try:
            channel = await self.token_channels.connect(request.token_channel)
            yield GenerationChunk(request.request_id, num_prompt_tokens=len(request.prompt_token_ids),
                                  replica_id=self.replica_id, via_channel=channel is not None)
            async with contextlib.aclosing(self._chunks(request, admitted, stream)) as chunks:
                if channel is None:
                    async for chunk in chunks:
                        yield chunk
                else:
                    key = request.token_channel.key
                    async for chunk in chunks:
                        await channel.send(key, chunk)
        finally:
            self.num_open_streams -= 1
            stream.close()
            self.core.finished(admitted)

    async def _chunks(self, request: GenerateRequest, admitted: AdmittedRequest,
                      stream: RequestStream) -> AsyncIterator[GenerationChunk]:
        """The request's chunks after admission, keep-alives and folding included (generate_stream)."""
        pending: GenerationChunk | None = None  # folded outputs not sent yet
        sent_s = float("-inf")
        first_token_sent = False
        while True:
            wait_s = (self.keepalive_interval_s if pending is None
                      else max(0.0, sent_s + self._stream_interval_s() - self.clock()))
            out = await _next_output(stream, wait_s)
            if out is _END:
                return
            if out is None:
                if pending is not None:  # its interval is over
                    yield pending
                    pending, sent_s = None, self.clock()
                elif self.engine.seconds_since_alive() < self.engine_stall_s:
                    yield GenerationChunk(request.request_id, keepalive=True, replica_id=self.replica_id)
                continue
            for later in stream.ready():
                out.extend(later)
            if pending is None:
                pending = out
            else:
                pending.extend(out)
            if out.token_ids:
                self.core.first_token(admitted)
            if pending.finished:
                self._observe(pending, admitted.resumed)
                yield pending
                return
            if (pending.token_ids and not first_token_sent) or self.clock() - sent_s >= self._stream_interval_s():
                first_token_sent = first_token_sent or bool(pending.token_ids)
                yield pending
                pending, sent_s = None, self.clock()

    def _stream_interval_s(self) -> float:
        """How long a stream waits between two chunks: 0 within the budget, more beyond it, never
        more than max_stream_interval_s."""
        return min(self.num_open_streams / self.stream_chunks_per_s, self.max_stream_interval_s)

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        """Run a request to the end and return it as one finished chunk."""
        return await whole_response(request.request_id, self.generate_stream(request))

    def _admit(self, request: GenerateRequest) -> tuple[AdmittedRequest, RequestStream]:
        if not isinstance(request, GenerateRequest):
            raise invalid(None, f"expected a GenerateRequest, got {type(request).__name__}")
        if not isinstance(request.params, SamplingParams):
            raise invalid(None, "params must be a SamplingParams")
        try:
            admitted = self.core.admit(request.request_id, request.priority, bool(request.resumed_token_ids))
        except ReplicaOverloaded as refusal:
            raise overloaded(str(refusal), refusal.retry_after_s) from None
        try:
            return admitted, self._add_to_engine(request)
        except BaseException:
            self.core.finished(admitted)  # refused by the engine: it never joined the queue
            raise

    def _add_to_engine(self, request: GenerateRequest) -> RequestStream:
        try:
            return self.engine.add_request(
                request.prompt_token_ids, request.params, request_id=request.request_id, priority=request.priority,
                cache_key=request.cache_key, resumed_token_ids=request.resumed_token_ids,
                block_hashes=request.block_hashes)
        except RequestRejected as exc:
            raise rejected(exc) from None
        except SamplingParamsError as exc:
            raise invalid(exc.param, str(exc)) from None
        except EngineDeadError as exc:
            raise not_ready(f"the engine on replica {self.replica_id} is not running: {exc}") from None
        except ValueError as exc:
            raise invalid(None, str(exc)) from None

    def _observe(self, out: GenerationChunk, resumed: bool = False) -> None:
        timings = out.timings
        if timings is None or out.finish_reason == "abort":
            return
        if timings.ttft_s is not None and not resumed:
            self.ttft_s.observe(timings.ttft_s)
        if timings.queue_s is not None:
            self.queue_s.observe(timings.queue_s)
        if timings.finished_s is not None:
            self.e2e_s.observe(timings.finished_s - timings.arrival_s)
        times = timings.token_times_s
        for earlier, later in zip(times, times[1:]):
            self.itl_s.observe(later - earlier)

    # ---- observation (Serve hooks and the ingress) --------------------------------------------

    async def model_info(self) -> ModelInfo:
        return self.info

    async def check_health(self) -> None:
        """Serve restarts a replica whose health check raises: an engine loop that stopped, or
        one that has not begun a step for engine_hung_s."""
        if not self.engine.is_running:
            raise RuntimeError(f"the engine on replica {self.replica_id} has stopped")
        stalled_s = self.engine.seconds_since_alive()
        if stalled_s > self.engine_hung_s:
            raise RuntimeError(f"the engine loop on replica {self.replica_id} has not begun a step for "
                               f"{stalled_s:.0f} s")

    async def ready(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "model_loaded": True, "engine_running": self.engine.is_running,
                "load_times_s": dict(self.load_times_s), "pid": os.getpid(),
                "engine_pid": self.engine.core_pid}

    async def record_routing_stats(self) -> dict[str, Any]:
        """The RoutingReport for the request routers, polled by the Serve controller: load, free
        KV blocks and the prefix cache's changes since a few reports back (now and then, or
        after a gap in the engine's change log, every hash it holds); `report_seq` tells a new
        report."""
        async with self._routing_report_lock:
            if not self.engine.is_running:  # routers stop choosing it at once, before Serve replaces it
                return self.core.routing_report(None).to_dict()
            stats = await self.engine.stats(include_block_hashes=True, block_hashes_since=self.core.report_base())
            return self.core.routing_report(stats).to_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The LoadReport the autoscaler (autoscaler/serve_policy.py) scales on
        (ReplicaCore.load_report); an absent TTFT p90 is left out."""
        return self.core.load_report(await self.engine.stats()).to_metrics()

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def metrics_snapshot(self) -> ReplicaMetrics:
        """This replica's metric families for the ingress: prometheus_client Metrics, which pickle."""
        stats = await self.engine.stats()
        return ReplicaMetrics(self.replica_id, self.info.served_model_name,
                              [*collect_families(self.metrics_registry), *_families(self, stats)])

    def shutdown(self) -> None:
        self.token_channels.close()
        self.engine.shutdown()

    def __del__(self) -> None:
        engine = self.__dict__.get("engine")
        if engine is not None:
            engine.shutdown(timeout_s=1.0)


# What _next_output returns after the last output.
_END = object()


async def _next_output(stream: RequestStream, timeout_s: float) -> GenerationChunk | object | None:
    """The stream's next output, None if none came within timeout_s, _END after the last one;
    the engine's errors as APIErrors."""
    try:
        return await stream.next_within(timeout_s)
    except StopAsyncIteration:
        return _END
    except EngineDeadError as exc:
        raise not_ready(f"the engine stopped while serving this request: {exc}") from None
    except RequestFailed as exc:  # this request made a step fail; the engine and the rest go on
        raise APIError(str(exc), 500, "internal_error", None, "generation_failed") from None
    except APIError:
        raise
    except Exception as exc:
        raise internal(f"generation failed: {type(exc).__name__}: {exc}") from None


def _engine_config(model: str | None, engine_args: dict[str, Any] | None) -> EngineConfig:
    args = dict(engine_args or {})
    if "model" in args and model is not None and args["model"] != model:
        raise ValueError(f"model is given twice: {model!r} and engine_args.model {args['model']!r}")
    args.setdefault("model", model)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ValueError(f"unknown engine_args {unknown}; known: {sorted(fields)}")
    return EngineConfig(**args)


def _families(server: LLMServer, stats: EngineStats) -> list[Metric]:
    """The metrics whose counts are kept elsewhere (engine stats, the server's own counts), built
    from their current values at each snapshot rather than counted a second time."""
    return [
        GaugeMetricFamily("iterserve_num_requests_waiting", "Requests waiting to be scheduled.",
                          value=stats.num_waiting),
        GaugeMetricFamily("iterserve_num_requests_running", "Requests in the running batch.",
                          value=stats.num_running),
        GaugeMetricFamily("iterserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                          value=stats.kv_usage),
        by_label(CounterMetricFamily("iterserve_request_success_total", "Finished requests by finish reason.",
                                     labels=["finished_reason"]), stats.requests_finished),
        CounterMetricFamily("iterserve_prompt_tokens_total", "Prompt tokens admitted.",
                            value=stats.prompt_tokens_total),
        CounterMetricFamily("iterserve_generation_tokens_total", "Output tokens generated.",
                            value=stats.generation_tokens_total),
        CounterMetricFamily("iterserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                            value=stats.prefix_cache_query_tokens),
        CounterMetricFamily("iterserve_prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
                            value=stats.prefix_cache_hit_tokens),
        CounterMetricFamily("iterserve_num_preemptions_total", "Requests preempted for KV blocks.",
                            value=stats.num_preemptions),
        by_label(CounterMetricFamily("iterserve_requests_shed_total", "Requests refused with 429 under overload.",
                                     labels=["priority"]), {p.label: server.core.num_shed(p) for p in Priority}),
        CounterMetricFamily("iterserve_requests_resumed_total",
                            "Requests this replica continued after another replica died or stalled.",
                            value=server.core.num_resumed),
        by_label(GaugeMetricFamily("iterserve_model_load_seconds",
                                   "Seconds this replica spent loading before it could serve, by part.",
                                   labels=["part"]), server.load_times_s),
        GaugeMetricFamily("iterserve_oldest_waiting_seconds",
                          "Age of the oldest request still waiting for its first token.",
                          value=server.core.oldest_wait_s()),
    ]
