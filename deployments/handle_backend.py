"""HandleBackend: the OpenAI service's Backend over a DeploymentHandle to the LLMServer replicas.

A replica can die (SIGKILL, OOM, a node lost), freeze (SIGSTOP, a hung driver) or refuse a request
because its engine stopped. None of that may fail a request that did not cause it, so every
generation runs as a sequence of attempts, each on another replica:

- An attempt fails over when its replica is lost (Ray's actor errors, a stream that ends before
  the request finished), when it refuses with 503 (engine not running) or 429 (its own backstop),
  when no first reply (the admission chunk) comes within `first_reply_timeout_s`, or when a
  stream that began goes `stall_timeout_s` without a chunk. Replicas send a keep-alive every
  second while their engine works (deployments/llm_server.py), so silence means the replica, not
  the request, is stuck.
- The next attempt resumes the request where the client's stream stands: the same prompt, plus
  `resumed_token_ids`, the output tokens already passed on. The new replica recomputes them (its
  prefix cache makes the prompt part cheap) and continues exactly as the old one would have for a
  greedy or seeded request, so the client sees one stream with no token repeated or missing, and
  usage counts every token once.
- Each attempt asks the router to avoid the replicas that failed before (`avoid_replica_ids`);
  the router writes its choice into the request (`routed_replica_id`), so even an attempt that hung
  before any reply names its replica.
- After `max_attempts` the request fails with 503 and the reason of the last attempt. Errors the
  request itself caused (400, 500 generation_failed) are never retried: they would fail again.

With a token channel (deployments/token_channel.py), a replica on this node sends the chunks after
admission over a loopback connection; the attempt then reads them from its Inbox, into which the
Ray stream's end or error is passed too, under the same stall timeout.

Before any attempt, the ingress's admission control (`IngressAdmission`, when given) admits the
request or refuses it with 429, and gives it up with 503 if no first token comes in time: the
sequence of attempts is a stage behind it, so its queue timeout covers every attempt.

Broadcasts (health, metrics) wait for each replica separately: one slow replica costs its own
reply, never the others' (it is named in the answer instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo, whole_response
from deployments.errors import APIError, internal, not_ready, overloaded
from deployments.ingress_admission import IngressAdmission
from deployments.metrics import AdmissionStats, FailoverCounters, ReplicaMetrics, TokenChannelCounters
from deployments.retry_policy import RetryPolicy
from deployments.token_channel import END_OF_CALL, ChannelClosed, Inbox, TokenChannelServer

# What Ray raises when the replica behind a call is gone (killed, crashed, its node lost).
_REPLICA_LOST = (RayActorError, ReplicaUnavailableError, ObjectLostError, WorkerCrashedError, NodeDiedError)
# Replies from every replica (health, metrics) are awaited at most this long, each.
BROADCAST_TIMEOUT_S = 5.0
# /health answers from a result at most this old, and concurrent probes share one broadcast: a
# load balancer (or an attacker) polling it cannot turn each probe into a call to every replica.
HEALTH_CACHE_S = 1.0


class AttemptFailed(Exception):
    """One attempt lost its replica; another replica may still serve the request."""

    def __init__(self, reason: str, replica_id: str | None, refusal: APIError | None = None) -> None:
        super().__init__(reason)
        self.replica_id = replica_id
        # The replica's own refusal (429 or 503), when that is what ended the attempt.
        self.refusal = refusal


class HandleBackend:
    """The Backend over a DeploymentHandle; Ray and Serve failures become APIErrors."""

    def __init__(self, handle: DeploymentHandle, app_name: str, deployment_name: str,
                 retry: RetryPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 admission: IngressAdmission | None = None,
                 token_channel: TokenChannelServer | None = None) -> None:
        """`token_channel`: where replicas on this node send the chunks after admission (None:
        every chunk comes over Ray; deployments/token_channel.py)."""
        self.handle = handle
        self.token_channel = token_channel
        self.app_name = app_name
        self.deployment_name = deployment_name
        self.retry = retry or RetryPolicy()
        self.clock = clock
        # None: every request is sent (the replicas' own 429 is then the only shedding).
        self.admission = admission
        # Requests resumed on another replica, and attempts that failed over, since start.
        self.num_migrated = 0
        self.num_failed_attempts = 0
        # Replica ids that answered a broadcast, with when: a replica that falls silent is named.
        self._seen_replicas: dict[str, float] = {}
        self._health: tuple[float, tuple[bool, dict[str, Any]]] | None = None
        self._health_refresh: asyncio.Future[tuple[bool, dict[str, Any]]] | None = None

    async def model_info(self) -> ModelInfo:
        return await _call(lambda: self.handle.model_info.remote())

    def failover_counters(self) -> FailoverCounters:
        """For /metrics: attempts that failed over, and requests resumed mid-stream elsewhere."""
        return FailoverCounters(num_failed_attempts=self.num_failed_attempts, num_migrated=self.num_migrated)

    def admission_stats(self) -> AdmissionStats | None:
        return self.admission.stats() if self.admission is not None else None

    def token_channel_counters(self) -> TokenChannelCounters | None:
        channel = self.token_channel
        if channel is None:
            return None
        return TokenChannelCounters(num_chunks=channel.num_frames, num_dropped=channel.num_dropped,
                                    num_refused=channel.num_refused, num_open=channel.num_open)

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        """Sent as a stream, so that the admission stage sees its first token."""
        return await whole_response(request.request_id, self.generate_stream(request))

    def generate_stream(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        """The request's chunks: admitted first, then across as many attempts as its replicas need
        (module docstring)."""
        if self.admission is None:
            return self._attempts(request)
        return self.admission.watch(request, self._attempts)

    async def _attempts(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        progress = _Progress(request)
        avoid: list[str] = []
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                async for chunk in self._attempt(progress.next_request(attempt, avoid), progress):
                    yield chunk
                return
            except AttemptFailed as failure:
                self.num_failed_attempts += 1
                if failure.replica_id is not None and failure.replica_id not in avoid:
                    avoid.append(failure.replica_id)
                if attempt == self.retry.max_attempts:
                    if failure.refusal is not None and failure.refusal.status == 429:
                        raise failure.refusal from None  # every replica tried is overloaded: a 429 it is
                    raise not_ready(f"the request failed on {attempt} model replicas; the last one: {failure}; "
                                    "retry shortly") from None
                if progress.started:
                    self.num_migrated += 1
                await asyncio.sleep(self.retry.backoff_s * attempt)

    async def _attempt(self, request: GenerateRequest, progress: "_Progress") -> AsyncIterator[GenerationChunk]:
        if progress.done_by_length():  # every token arrived, only the finished chunk was lost
            yield progress.finished_by_length()
            return
        inbox: Inbox | None = None
        opened = await self.token_channel.open() if self.token_channel is not None else None
        if opened is not None:
            request.token_channel, inbox = opened
        responses = _remote(lambda: self.handle.options(stream=True).generate_stream.remote(request))
        finished = False
        watcher: asyncio.Future[None] | None = None
        try:
            chunk = await self._next_chunk(responses, self.retry.first_reply_timeout_s, request, None)
            replica_id = chunk.replica_id
            if chunk.via_channel and inbox is not None:
                chunk.via_channel = False
                watcher = asyncio.ensure_future(_watch_call(responses, inbox))
                chunks = self._channel_chunks(inbox, replica_id)
            else:
                chunks = self._ray_chunks(responses, request, replica_id)
            async with contextlib.aclosing(chunks):
                while True:
                    if not chunk.keepalive:
                        finished = chunk.finished
                        out = progress.accept(chunk)
                        if out is not None:
                            yield out
                        if finished:
                            return
                    chunk = await chunks.__anext__()
        finally:
            if inbox is not None:
                self.token_channel.close(request.token_channel.key)
            if watcher is not None:
                # A finished attempt's Ray stream ends by itself, just after its last chunk was sent.
                if finished:
                    asyncio.get_running_loop().call_later(self.retry.stall_timeout_s, watcher.cancel)
                else:
                    watcher.cancel()
            if not finished:  # failed over, or the caller left: the replica aborts the request
                responses.cancel()

    async def _ray_chunks(self, responses: Any, request: GenerateRequest,
                          replica_id: str | None) -> AsyncIterator[GenerationChunk]:
        """An attempt's chunks after admission, over its Ray stream."""
        while True:
            chunk = await self._next_chunk(responses, self.retry.stall_timeout_s, request, replica_id)
            replica_id = chunk.replica_id or replica_id
            yield chunk

    async def _channel_chunks(self, inbox: Inbox, replica_id: str | None) -> AsyncIterator[GenerationChunk]:
        """An attempt's chunks after admission, over the token channel, with what its Ray stream
        brings (`_watch_call`: the replica's loss). That stream ends empty once the last chunk was
        sent, which may still be on its way: only silence for stall_timeout_s, a closed channel or
        the stream's error fails the attempt."""
        while True:
            try:
                item = await inbox.get(self.retry.stall_timeout_s)
            except TimeoutError:
                raise AttemptFailed(f"no chunk from the replica for {self.retry.stall_timeout_s:g} s",
                                    replica_id) from None
            if item is END_OF_CALL:
                continue
            if isinstance(item, ChannelClosed):
                raise AttemptFailed(str(item), replica_id)
            if isinstance(item, BaseException):
                raise _attempt_failure(item, replica_id)
            yield item

    async def _next_chunk(self, responses: Any, timeout_s: float, request: GenerateRequest,
                          replica_id: str | None) -> GenerationChunk:
        """The next chunk of one attempt; AttemptFailed when its replica is lost, refuses or stalls."""
        try:
            return await asyncio.wait_for(responses.__anext__(), timeout_s)
        except StopAsyncIteration:
            raise AttemptFailed("the replica closed the stream before the request finished",
                                replica_id or request.routed_replica_id) from None
        except (asyncio.TimeoutError, TimeoutError):
            what = "no chunk" if replica_id else "no reply"
            raise AttemptFailed(f"{what} from the replica for {timeout_s:g} s",
                                replica_id or request.routed_replica_id) from None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            raise _attempt_failure(exc, replica_id or request.routed_replica_id) from None

    # ---- observation --------------------------------------------------------------------------

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Cached for HEALTH_CACHE_S; concurrent callers share one refresh."""
        now_s = self.clock()
        if self._health is not None and now_s - self._health[0] < HEALTH_CACHE_S:
            return self._health[1]
        if self._health_refresh is None:
            self._health_refresh = asyncio.ensure_future(self._probe_health())
            self._health_refresh.add_done_callback(self._health_refreshed)
        return await asyncio.shield(self._health_refresh)

    def _health_refreshed(self, future: "asyncio.Future[tuple[bool, dict[str, Any]]]") -> None:
        self._health_refresh = None
        if not future.cancelled() and future.exception() is None:
            self._health = (self.clock(), future.result())

    async def _probe_health(self) -> tuple[bool, dict[str, Any]]:
        states, (replies, silent) = await asyncio.gather(self.replica_states(), self._broadcast("ready", _ready_replica))
        ready = sum(1 for r in replies if r.get("model_loaded") and r.get("engine_running"))
        running = states.get("RUNNING", 0)
        # Every replica Serve counts must be running and must have said it is ready.
        healthy = running > 0 and sum(states.values()) == running and ready >= running
        detail: dict[str, Any] = {"replicas": states, "ready_replicas": ready}
        if silent:
            detail["unresponsive_replicas"] = silent
        return healthy, detail

    async def metrics_snapshots(self) -> list[ReplicaMetrics]:
        replies, _ = await self._broadcast("metrics_snapshot", _metrics_replica)
        return replies

    async def _broadcast(self, method: str, replica_of: Callable[[Any], str | None]) -> tuple[list[Any], dict[str, Any]]:
        """(replies, silent): the replies of every replica that answered within BROADCAST_TIMEOUT_S
        with a reply `replica_of` names a replica for (None: not a reply of this method), and what
        is known of the ones that did not (a count, and the ids of replicas that answered an
        earlier broadcast and not this one)."""
        try:
            response = self.handle.broadcast(method)
            results = await asyncio.wait_for(_replica_results(response), BROADCAST_TIMEOUT_S)
        except (DeploymentUnavailableError, asyncio.TimeoutError, TimeoutError):
            return [], {}
        calls = [asyncio.ensure_future(r.get_async()) for r in results]
        done, pending = await asyncio.wait(calls, timeout=BROADCAST_TIMEOUT_S) if calls else (set(), set())
        for call in pending:
            call.cancel()
        replies = [c.result() for c in calls if c in done and c.exception() is None and replica_of(c.result())]
        now_s = self.clock()
        answered = {replica_of(r) for r in replies}
        for replica in answered:
            self._seen_replicas[replica] = now_s
        failed = len(calls) - len(replies)
        if not failed:
            self._seen_replicas = {r: t for r, t in self._seen_replicas.items() if r in answered}
            return replies, {}
        missing = sorted(r for r in self._seen_replicas if r not in answered)
        return replies, {"count": failed, "timeout_s": BROADCAST_TIMEOUT_S, "last_seen": missing}

    async def replica_states(self) -> dict[str, int]:
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        deployment = app.deployments.get(self.deployment_name) if app is not None else None
        if deployment is None:
            return {}
        return {str(getattr(state, "value", state)): n for state, n in deployment.replica_states.items() if n}


class _Progress:
    """What the client has been sent of one request, across attempts."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.token_ids: list[int] = list(request.resumed_token_ids)
        self.admitted = False
        # The first attempt's prompt cache hits: what usage reports, whichever replica finishes.
        self.num_cached_tokens: int | None = None
        self.last: GenerationChunk | None = None

    @property
    def started(self) -> bool:
        return bool(self.token_ids)

    def next_request(self, attempt: int, avoid: list[str]) -> GenerateRequest:
        if attempt == 1:
            request = self.request
            request.avoid_replica_ids = list(avoid)
            return request
        # A fresh id per attempt: the old replica may still hold the old one (it froze, then woke).
        return dataclasses.replace(self.request, request_id=f"{self.request.request_id}-{attempt}",
                                   resumed_token_ids=list(self.token_ids), avoid_replica_ids=list(avoid),
                                   routed_replica_id=None)

    def accept(self, chunk: GenerationChunk) -> GenerationChunk | None:
        """The chunk to pass on, or None. Only the first attempt's admission chunk goes out."""
        chunk.request_id = self.request.request_id
        if not self.admitted:
            self.admitted = True
            return chunk
        if not chunk.token_ids and not chunk.finished and not chunk.text:
            return None  # a later attempt's admission chunk
        if self.num_cached_tokens is None:
            self.num_cached_tokens = chunk.num_cached_tokens
        chunk.num_cached_tokens = self.num_cached_tokens
        self.token_ids.extend(chunk.token_ids)
        self.last = chunk
        return chunk

    def done_by_length(self) -> bool:
        return len(self.token_ids) >= self.request.params.max_tokens

    def finished_by_length(self) -> GenerationChunk:
        last = self.last
        return GenerationChunk(self.request.request_id, finished=True, finish_reason="length",
                               num_prompt_tokens=len(self.request.prompt_token_ids),
                               num_output_tokens=len(self.token_ids),
                               num_cached_tokens=self.num_cached_tokens or 0,
                               replica_id=last.replica_id if last else None)


@contextlib.contextmanager
def _own_request_context() -> Iterator[None]:
    """Give the handle call its own Serve request id.

    Serve's request context carries the HTTP request's internal id into every handle call made
    while serving it, and Ray 2.60's RequestRouter matches a routing decision to its pending call
    by that id: the second of two calls sharing it is never routed, and its routing task spins at
    100% CPU (a completions request with two prompts would hang). Each call gets a fresh id."""
    from ray.serve import context

    current = context._get_serve_request_context()
    token = context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    try:
        yield
    finally:
        context._serve_request_context.reset(token)


def _remote(make_call: Callable[[], Any]) -> Any:
    with _own_request_context():
        return make_call()


async def _replica_results(response: Any) -> list[Any]:
    """The per-replica results of a broadcast, to be awaited one by one. Ray 2.60 only offers
    awaiting them all under one timeout, which loses every reply to one slow replica."""
    fetch = getattr(response, "_fetch_replica_results_async", None)
    if fetch is None:  # another Ray: all replies or none
        return [_Settled(r) for r in await response.results_async(return_exceptions=True)]
    return await fetch()


class _Settled:
    def __init__(self, value: Any) -> None:
        self.value = value

    async def get_async(self) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


async def _call(make_call: Callable[[], Any]) -> Any:
    response = _remote(make_call)
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
    except BaseException as exc:
        raise _api_error(exc) from None


async def _watch_call(responses: Any, inbox: Inbox) -> None:
    """Pass an attempt's Ray stream into its Inbox: whatever still comes, then END_OF_CALL, or the
    exception that ended it (the replica was lost, or refused)."""
    try:
        async for chunk in responses:
            inbox.put(chunk)
        inbox.put(END_OF_CALL)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        inbox.put(exc)


def _attempt_failure(exc: BaseException, replica_id: str | None) -> BaseException:
    """What an exception from an attempt's Ray stream means: AttemptFailed when another replica may
    serve the request (this one was lost, or refused with 429 or 503), else the request's error."""
    if isinstance(exc, APIError):
        if exc.status in (429, 503):
            return AttemptFailed(f"the replica refused: {exc.message}", replica_id, _plain_api_error(exc))
        return _plain_api_error(exc)
    if isinstance(exc, _REPLICA_LOST):
        return AttemptFailed(f"the replica was lost ({type(exc).__name__})", replica_id)
    if isinstance(exc, grpc.RpcError):  # handle calls over gRPC: the call failed, not the request
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        return AttemptFailed(f"the call to the replica failed over gRPC ({code})", replica_id)
    return _api_error(exc)


def _plain_api_error(exc: APIError) -> APIError:
    """An APIError raised in a replica arrives as Ray's subclass of it; rebuild the plain one."""
    return APIError(exc.message, exc.status, exc.type, exc.param, exc.code, exc.retry_after_s)


def _api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt)):
        return exc
    if isinstance(exc, APIError):
        return _plain_api_error(exc)
    if isinstance(exc, BackPressureError):
        return overloaded("every model replica's queue is full; retry shortly", 1.0)
    if isinstance(exc, (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError)):
        return not_ready(f"the model replica is unavailable ({type(exc).__name__}); retry shortly")
    if isinstance(exc, RayTaskError):
        return internal(f"the model replica failed: {exc.cause!r}" if exc.cause else str(exc))
    return internal(f"{type(exc).__name__}: {exc}")


def _ready_replica(reply: Any) -> str | None:
    """The replica id in a `ready()` reply (a dict), or None for anything else."""
    replica = reply.get("replica") if isinstance(reply, dict) else None
    return replica if isinstance(replica, str) else None


def _metrics_replica(reply: Any) -> str | None:
    """The replica id of a `metrics_snapshot()` reply, or None for anything else."""
    return reply.replica if isinstance(reply, ReplicaMetrics) and isinstance(reply.replica, str) else None
