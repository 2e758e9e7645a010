"""HandleBackend's failover and migration over fake handles to real LLMServers (fake KV runner).

Each fake replica is a real LLMServer; the fake handle routes like the real router (first replica
not in `avoid_replica_ids`, written back into `routed_replica_id`) and can kill a replica's
streams (Ray's ActorDiedError) or freeze them (no chunk, no keep-alive, ever) after some chunks.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from ray.exceptions import ActorDiedError

from contracts.priority import Priority
from contracts.serving import GenerateRequest
from deployments.errors import APIError
from deployments.handle_backend import HandleBackend
from deployments.llm_server import LLMServer
from deployments.replica_core import ReplicaCore
from deployments.retry_policy import RetryPolicy
from deployments.token_channel import TokenChannelServer
from model_worker.engine import engine_loop
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from tests.unit.fakes import ByteTokenizer, FakeKVRunner

VOCAB = 259  # byte tokens 3..258: every token decodes


def make_replica(replica_id: str, node_id: str | None = None) -> LLMServer:
    runner = FakeKVRunner(256, 4, 1024, VOCAB, step_delay_s=0.002)
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=runner, tokenizer=ByteTokenizer())
    # A chunk per token (no folding under the chunk budget): the faults strike after a count of chunks.
    return LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", replica_id=replica_id,
                     keepalive_interval_s=0.05, stream_chunks_per_s=1e6, node_id=lambda: node_id)


class Killed(Exception):
    """Ends a replica's generator where a killed replica would stop."""


class FakeResponses:
    """One call's stream, driven as Ray drives a replica's generator: on its own, into a queue the
    caller reads. A fault strikes before the chunk numbered `fault[1]` (the admission chunk is 0)
    whether it goes over Ray or the token channel: "kill" ends the call with ActorDiedError, "rpc"
    with gRPC's error (Serve's handle calls over gRPC), "freeze" sends nothing more, ever."""

    def __init__(self, replica: LLMServer, request: GenerateRequest, fault: tuple[str, int] | None) -> None:
        self.stream = replica.generate_stream(request)
        self.fault = fault
        self.sent = 0
        self.cancelled = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.driver = asyncio.ensure_future(self._drive())

    async def before_chunk(self) -> None:
        if self.fault is not None and self.sent >= self.fault[1]:
            if self.fault[0] in ("kill", "rpc"):
                raise Killed()
            await asyncio.Event().wait()  # frozen: nothing ever comes
        self.sent += 1

    async def _drive(self) -> None:
        try:
            async for chunk in self.stream:
                await self.before_chunk()
                self.queue.put_nowait(chunk)
            self.queue.put_nowait(StopAsyncIteration())
        except Killed:
            if self.fault[0] == "rpc":  # a handle call over gRPC that broke
                self.queue.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                                           grpc.aio.Metadata(), "stream reset"))
            else:
                self.queue.put_nowait(ActorDiedError())
        except Exception as exc:
            self.queue.put_nowait(exc)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True
        self.driver.cancel()


class FaultyChannels:
    """A replica's TokenChannelSender whose connections apply each call's fault to its chunks."""

    def __init__(self, replica: LLMServer, handle: "FakeHandle") -> None:
        self.real = replica.token_channels
        self.handle = handle

    async def connect(self, address):
        connection = await self.real.connect(address)
        return None if connection is None else FaultyConnection(connection, self.handle.responses[address.key])

    def close(self) -> None:
        self.real.close()


class FaultyConnection:
    def __init__(self, connection, responses: FakeResponses) -> None:
        self.connection = connection
        self.responses = responses

    async def send(self, key, chunk) -> None:
        await self.responses.before_chunk()
        await self.connection.send(key, chunk)


class FakeHandle:
    def __init__(self, replicas: dict[str, LLMServer]) -> None:
        self.replicas = replicas
        # replica id -> ("kill" | "freeze", chunks it sends first) for its next stream.
        self.faults: dict[str, tuple[str, int]] = {}
        self.calls: list[tuple[str, GenerateRequest]] = []
        # Token channel key -> the call that sends on it.
        self.responses: dict[str, FakeResponses] = {}
        self.generate_stream = self
        for replica in replicas.values():
            replica.token_channels = FaultyChannels(replica, self)

    def options(self, **_):
        return self

    def remote(self, request: GenerateRequest) -> FakeResponses:
        replica_id = next(r for r in self.replicas if r not in request.avoid_replica_ids)
        request.routed_replica_id = replica_id
        self.calls.append((replica_id, request))
        responses = FakeResponses(self.replicas[replica_id], request, self.faults.pop(replica_id, None))
        if request.token_channel is not None:
            self.responses[request.token_channel.key] = responses
        return responses


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["ray", "token_channel"])
def cluster(request):
    """Three replicas behind a fake handle; their chunks come back over the call's stream ("ray"),
    or, after admission, over the ingress's token channel on loopback ("token_channel")."""
    node = "node-1" if request.param == "token_channel" else None
    replicas = {name: make_replica(name, node) for name in ("r0", "r1", "r2")}
    handle = FakeHandle(replicas)
    channel = TokenChannelServer("node-1") if node else None
    backend = HandleBackend(handle, "app", "LLMServer",
                            RetryPolicy(first_reply_timeout_s=0.5, stall_timeout_s=0.5, backoff_s=0.0),
                            token_channel=channel)
    yield handle, backend
    for replica in replicas.values():
        replica.shutdown()
    if channel is not None:
        assert channel.num_open == 0, "every attempt closed its inbox"
        assert channel.num_refused == 0


def request(max_tokens=24, **params):
    prompt = [3 + b for b in b"migrate me"]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    return GenerateRequest(prompt, sampling, request_id="req")


def with_id(req: GenerateRequest, request_id: str) -> GenerateRequest:
    req.request_id = request_id
    return req


async def collect(backend, req):
    chunks = [chunk async for chunk in backend.generate_stream(req)]
    tokens = [t for c in chunks for t in c.token_ids]
    return chunks, tokens, "".join(c.text for c in chunks)


@pytest.mark.parametrize("fault", ["kill", "freeze", "rpc"])
@pytest.mark.parametrize("after_chunks", [1, 2, 6])
def test_a_stream_whose_replica_dies_or_freezes_continues_on_another_whole(cluster, fault, after_chunks):
    handle, backend = cluster

    async def main():
        _, clean_tokens, clean_text = await collect(backend, request())
        handle.faults["r0"] = (fault, after_chunks)
        chunks, tokens, text = await collect(backend, request())
        return clean_tokens, clean_text, chunks, tokens, text

    clean_tokens, clean_text, chunks, tokens, text = run(main())
    assert tokens == clean_tokens and text == clean_text, "no token repeated or missing"
    last = chunks[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.num_output_tokens == 24 and last.num_prompt_tokens == len(request().prompt_token_ids)
    assert [replica for replica, _ in handle.calls[-2:]] == ["r0", "r1"]
    resumed = handle.calls[-1][1]
    assert resumed.avoid_replica_ids == ["r0"] and resumed.request_id == "req-2"
    assert len(resumed.resumed_token_ids) == sum(len(c.token_ids) for c in chunks[:after_chunks])
    assert chunks[0].token_ids == [] and sum(1 for c in chunks if not c.token_ids and not c.finished) == 1
    assert backend.num_migrated == (1 if after_chunks > 1 else 0)
    if backend.token_channel is not None:  # every chunk after admission came over it
        assert backend.token_channel.num_frames >= len(chunks) - 2


def test_replicas_on_another_node_stream_over_ray_though_the_ingress_has_a_channel():
    replicas = {name: make_replica(name, "node-2") for name in ("r0", "r1")}
    handle = FakeHandle(replicas)
    channel = TokenChannelServer("node-1")
    backend = HandleBackend(handle, "app", "LLMServer", RetryPolicy(stall_timeout_s=0.5, backoff_s=0.0),
                            token_channel=channel)
    handle.faults["r0"] = ("kill", 3)
    try:
        chunks, tokens, _ = run(collect(backend, request()))
    finally:
        for replica in replicas.values():
            replica.shutdown()
    assert len(tokens) == 24 and chunks[-1].finished and [r for r, _ in handle.calls] == ["r0", "r1"]
    assert channel.num_frames == 0 and channel.num_open == 0


def test_a_seeded_request_continues_with_the_same_tokens(cluster):
    """Sampling noise is drawn from (seed, output index): the next replica draws what the first
    would have."""
    handle, backend = cluster

    async def main():
        _, clean, _ = await collect(backend, request(seed=5))
        handle.faults["r0"] = ("kill", 4)
        _, migrated, _ = await collect(backend, request(seed=5))
        return clean, migrated

    clean, migrated = run(main())
    assert migrated == clean


def test_steps_longer_than_the_stall_limits_fail_nothing_while_the_model_moves(monkeypatch):
    """Steps of 1 s against an engine stall limit of 0.3 s and an ingress stall timeout of 0.5 s
    (a full token budget of prompts on a slow CPU against 5 s and 10 s): the engine loop's
    heartbeat keeps the replica's keep-alives going, so the request finishes on its first replica.
    Without it, 41 of 64 requests sent at once failed over and failed (docs/benchmarks.md,
    eighteenth pass)."""
    monkeypatch.setattr(engine_loop, "HEARTBEAT_S", 0.05)
    replicas = {}
    for name in ("r0", "r1"):
        runner = FakeKVRunner(256, 4, 1024, VOCAB, step_delay_s=1.0)
        engine = LLMEngine(EngineConfig(block_size=4), model_runner=runner, tokenizer=ByteTokenizer())
        replicas[name] = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m", replica_id=name,
                                   keepalive_interval_s=0.05, engine_stall_s=0.3, stream_chunks_per_s=1e6)
    handle = FakeHandle(replicas)
    backend = HandleBackend(handle, "app", "LLMServer", RetryPolicy(first_reply_timeout_s=0.5, stall_timeout_s=0.5,
                                                                     backoff_s=0.0))
    try:
        chunks, tokens, _ = run(collect(backend, request(max_tokens=2)))
    finally:
        for replica in replicas.values():
            replica.shutdown()
    assert len(tokens) == 2 and chunks[-1].finished
    assert [r for r, _ in handle.calls] == ["r0"] and backend.num_migrated == 0


def test_a_replica_that_never_answers_is_avoided(cluster):
    handle, backend = cluster
    handle.faults["r0"] = ("freeze", 0)
    chunks, tokens, _ = run(collect(backend, request(max_tokens=5)))
    assert len(tokens) == 5 and chunks[-1].finished
    assert [r for r, _ in handle.calls] == ["r0", "r1"]


def test_after_max_attempts_the_request_fails_with_a_clear_error(cluster):
    handle, backend = cluster

    async def main():
        _, clean, _ = await collect(backend, request())
        for name in ("r0", "r1", "r2"):
            handle.faults[name] = ("kill", 3)
        seen = []
        with pytest.raises(APIError) as info:
            async for chunk in backend.generate_stream(request()):
                seen.append(chunk)
        return clean, seen, info.value

    clean, seen, error = run(main())
    assert error.status == 503 and "3 model replicas" in error.message
    assert [r for r, _ in handle.calls[1:]] == ["r0", "r1", "r2"]
    tokens = [t for c in seen for t in c.token_ids]
    assert 0 < len(tokens) < len(clean) and tokens == clean[:len(tokens)], "what was sent stays right"


def test_errors_the_request_caused_are_not_retried(cluster):
    handle, backend = cluster
    bad = GenerateRequest([3, 4], SamplingParams(max_tokens=2000), request_id="long")  # over the context

    async def main():
        with pytest.raises(APIError) as info:
            async for _ in backend.generate_stream(bad):
                pass
        return info.value

    error = run(main())
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert len(handle.calls) == 1


def test_unary_generate_migrates_too(cluster):
    handle, backend = cluster

    async def main():
        clean = await backend.generate(request())
        handle.faults["r0"] = ("kill", 5)
        migrated = await backend.generate(request())
        return clean, migrated

    clean, migrated = run(main())
    assert migrated.text == clean.text and migrated.token_ids == clean.token_ids
    assert migrated.num_output_tokens == 24 and migrated.finish_reason == "length"


def test_when_every_replica_sheds_the_client_gets_429_with_retry_after(cluster):
    handle, backend = cluster
    saved = {name: replica.core for name, replica in handle.replicas.items()}
    for replica in handle.replicas.values():
        replica.core = ReplicaCore(replica.replica_id, replica.engine.limits, replica.clock,
                                   admission={"max_waiting_requests": 1})
        replica.core.admit("waiting", Priority.INTERACTIVE)  # as if one request waited on each

    async def main():
        with pytest.raises(APIError) as info:
            await backend.generate(request())
        return info.value

    error = run(main())
    assert error.status == 429 and error.code == "overloaded" and error.retry_after_s
    assert len(handle.calls) == 3
    for name, core in saved.items():
        handle.replicas[name].core = core


def test_the_admission_stage_comes_before_any_attempt(cluster):
    """The ingress's admission control is a stage of HandleBackend's generation path: a refused
    request reaches no replica, an admitted one leaves the queue at its first token whichever
    attempt brings it, and a unary request is watched through its stream."""
    from autoscaler.admission import AdmissionPolicy
    from deployments.ingress_admission import IngressAdmission
    from deployments.metrics import FailoverCounters

    handle, backend = cluster
    backend.admission = IngressAdmission(AdmissionPolicy(max_waiting_requests=1), backend.clock)

    async def main():
        held = backend.generate_stream(with_id(request(), "held"))
        await held.__anext__()  # admitted, no first token yet: the queue is full
        waiting = sum(backend.admission_stats().num_waiting.values())
        with pytest.raises(APIError) as refused:
            await backend.generate(with_id(request(), "refused"))
        calls_when_refused = len(handle.calls)
        await held.aclose()
        handle.faults["r0"] = ("kill", 1)  # after its admission chunk: the first token comes from r1
        whole = await backend.generate(with_id(request(), "unary"))
        return waiting, refused.value, calls_when_refused, whole

    waiting, refused, calls_when_refused, whole = run(main())
    assert waiting == 1 and refused.status == 429 and refused.code == "overloaded" and refused.retry_after_s
    assert calls_when_refused == 1, "the refused request reached no replica"
    assert whole.finished and whole.num_output_tokens == 24
    stats = backend.admission_stats()
    assert sum(stats.num_waiting.values()) == 0 and stats.num_shed[Priority.INTERACTIVE] == 1
    assert backend.failover_counters() == FailoverCounters(num_failed_attempts=1, num_migrated=0)
    assert [r for r, _ in handle.calls[-2:]] == ["r0", "r1"]


class CountingBroadcast:
    """handle.broadcast(...) that counts calls; each replica answers ready() after `delay_s`."""

    def __init__(self, replies, delay_s=0.05):
        self.calls = 0
        self.replies = replies
        self.delay_s = delay_s

    def __call__(self, method):
        self.calls += 1
        return self

    async def _fetch_replica_results_async(self):
        return [_Reply(r, self.delay_s) for r in self.replies]


class _Reply:
    def __init__(self, value, delay_s):
        self.value, self.delay_s = value, delay_s

    async def get_async(self):
        await asyncio.sleep(self.delay_s)
        return self.value


def test_health_is_cached_and_concurrent_probes_share_one_broadcast():
    """/health answers from a cached result, and concurrent probes share one broadcast: a broadcast
    to every replica per call would make it an unauthenticated amplifier."""
    from tests.unit.fakes import FakeClock

    clock = FakeClock()
    broadcast = CountingBroadcast([{"replica": "a", "model_loaded": True, "engine_running": True}])
    backend = HandleBackend(SimpleNamespace(broadcast=broadcast), "app", "LLMServer", clock=clock)

    async def states():
        return {"RUNNING": 1}

    backend.replica_states = states

    async def main():
        results = await asyncio.gather(*(backend.health() for _ in range(50)))
        assert broadcast.calls == 1 and all(r == (True, {"replicas": {"RUNNING": 1}, "ready_replicas": 1})
                                            for r in results)
        clock.advance(0.5)
        await backend.health()
        assert broadcast.calls == 1  # cached
        clock.advance(0.6)
        await backend.health()
        assert broadcast.calls == 2

    run(main())


def test_metrics_come_from_every_replica_that_answers_with_its_snapshot():
    """Replicas answer metrics_snapshot() with a ReplicaMetrics: each one counts, and a reply of
    another shape is no replica's metrics."""
    from deployments.metrics import ReplicaMetrics

    snapshots = [ReplicaMetrics("a", "m", []), ReplicaMetrics("b", "m", []), {"replica": "c"}]
    backend = HandleBackend(SimpleNamespace(broadcast=CountingBroadcast(snapshots, delay_s=0.0)), "app", "LLMServer")
    assert run(backend.metrics_snapshots()) == snapshots[:2]
