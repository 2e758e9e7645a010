"""OpenAIService: the completions and chat API over any backend of LLMServer replicas.

The ingress deployment builds one over a Serve handle, tests build one over an LLMServer in the
same process; both are `Backend`s. The service parses a body (deployments/openai_protocol.py),
turns it into one GenerateRequest per prompt, tokenized once and checked before any is sent
(deployments/request_builder.py), and shapes OpenAI responses.

A streaming call returns only once every prompt was admitted, so a refusal is still an HTTP status;
after that, errors arrive in the stream. Closing the returned iterator early (a client that hung
up) cancels every request it started, and their engines free the KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments import openai_protocol as oai
from deployments.errors import APIError
from deployments.metrics import Exposition, by_label
from deployments.request_builder import RequestBuilder


class Backend(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerationChunk: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]: ...

    async def health(self) -> tuple[bool, dict[str, Any]]: ...

    async def metrics_snapshots(self) -> list[dict[str, Any]]: ...

    async def replica_states(self) -> dict[str, int]: ...


class OpenAIService:
    def __init__(self, backend: Backend, tokenizer: Any, info: ModelInfo, ingress_id: str = "ingress") -> None:
        self.backend = backend
        self.info = info
        self.ingress_id = ingress_id
        self.requests = RequestBuilder(tokenizer, info)
        # (endpoint, status code) -> responses sent by this ingress replica.
        self.http_responses: dict[tuple[str, int], int] = {}

    # ---- the API ------------------------------------------------------------------------------

    async def create(self, kind: str, body: Any) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """A response dict, or for `stream: true` an iterator of chunk dicts (already admitted)."""
        parse = oai.parse_chat if kind == "chat" else oai.parse_completion
        parsed = parse(body, self.info.served_model_name)
        requests = await self.requests.build(parsed)
        if parsed.stream:
            streams = await _open_all(self.backend, requests)
            return EventStream(self._stream_events(parsed, streams), [s for _, s in streams])
        return await self._unary(parsed, requests)

    def models(self) -> dict[str, Any]:
        info = self.info
        return {"object": "list", "data": [{"id": info.served_model_name, "object": "model", "created": info.created,
                                            "owned_by": "iterserve", "max_model_len": info.max_model_len}]}

    async def metrics_text(self) -> str:
        exposition = Exposition()
        for snapshot in await self.backend.metrics_snapshots():
            replica = {"model_name": snapshot["model_name"], "replica": snapshot["replica"]}
            for family in snapshot["families"]:
                exposition.add(family, replica)
        model = {"model_name": self.info.served_model_name}
        states = dict(sorted((await self.backend.replica_states()).items()))
        exposition.add(by_label(GaugeMetricFamily("iterserve_replicas", "LLMServer replicas by state.",
                                                  labels=["state"]), states), model)
        admission = getattr(self.backend, "admission", None)
        if admission is not None:
            self._add_admission(exposition, admission.snapshot())
        failover = getattr(self.backend, "failover_counters", None)
        if failover is not None:
            counters = failover()
            ingress = {**model, "ingress": self.ingress_id}
            if "failed_attempts" in counters:
                exposition.add(CounterMetricFamily(
                    "iterserve_ingress_failed_attempts_total",
                    "Attempts whose replica died, froze or refused; each was retried elsewhere or failed.",
                    value=counters["failed_attempts"]), ingress)
            if "migrated" in counters:
                exposition.add(CounterMetricFamily(
                    "iterserve_ingress_requests_migrated_total",
                    "Requests resumed on another replica after some tokens were sent.",
                    value=counters["migrated"]), ingress)
        responses = CounterMetricFamily("iterserve_http_responses_total", "HTTP responses by endpoint and status.",
                                        labels=["endpoint", "status"])
        for (endpoint, status), count in sorted(self.http_responses.items()):
            responses.add_metric([endpoint, str(status)], count)
        exposition.add(responses, {"ingress": self.ingress_id})
        return exposition.render()

    def _add_admission(self, exposition: Exposition, snapshot: dict[str, float]) -> None:
        """The ingress's admission control (autoscaler/admission.py), labelled by ingress replica."""
        labels = {"model_name": self.info.served_model_name, "ingress": self.ingress_id}
        waiting = GaugeMetricFamily("iterserve_ingress_requests_waiting",
                                    "Requests this ingress sent that have no first token yet.", labels=["priority"])
        shed = CounterMetricFamily("iterserve_ingress_requests_shed_total",
                                   "Requests this ingress refused with 429 before sending them.", labels=["priority"])
        timed_out = CounterMetricFamily("iterserve_ingress_queue_timeouts_total",
                                        "Admitted requests given up with 503 for want of a first token in time.",
                                        labels=["priority"])
        for priority in ("interactive", "batch"):
            waiting.add_metric([priority], snapshot[f"num_waiting_first_token_{priority}"])
            shed.add_metric([priority], snapshot[f"num_shed_{priority}"])
            timed_out.add_metric([priority], snapshot[f"num_timed_out_{priority}"])
        predicted = GaugeMetricFamily("iterserve_ingress_predicted_wait_seconds",
                                      "Wait for a first token this ingress predicts for a new request.",
                                      value=snapshot["predicted_wait_s"])
        for family in (waiting, shed, timed_out, predicted):
            exposition.add(family, labels)

    def record_response(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.http_responses[key] = self.http_responses.get(key, 0) + 1

    # ---- responses ----------------------------------------------------------------------------

    async def _unary(self, parsed: oai.ParsedRequest, requests: list[GenerateRequest]) -> dict[str, Any]:
        results = await _all_or_nothing([self.backend.generate(r) for r in requests])
        choices = [oai.choice(parsed, i, r.text, r.finish_reason, r.stop_reason) for i, r in enumerate(results)]
        usage = oai.usage(sum(r.num_prompt_tokens for r in results), sum(r.num_output_tokens for r in results),
                          sum(r.num_cached_tokens for r in results))
        return oai.completion_response(parsed, choices, usage)

    async def _stream_events(self, parsed: oai.ParsedRequest,
                             streams: list[tuple[GenerationChunk, AsyncIterator[GenerationChunk]]]
                             ) -> AsyncIterator[dict[str, Any]]:
        prompt_tokens = [first.num_prompt_tokens for first, _ in streams]
        output_tokens = [0] * len(streams)
        cached_tokens = [0] * len(streams)
        if parsed.kind == "chat":
            for index in range(len(streams)):
                yield oai.stream_chunk(parsed, index, "", role=True)
        async with contextlib.aclosing(_merge([stream for _, stream in streams])) as merged:
            async for index, chunk in merged:
                output_tokens[index] = chunk.num_output_tokens
                cached_tokens[index] = chunk.num_cached_tokens
                if chunk.text or chunk.finished:
                    yield oai.stream_chunk(parsed, index, chunk.text, chunk.finish_reason, chunk.stop_reason)
        if parsed.include_usage:
            yield oai.usage_chunk(parsed, oai.usage(sum(prompt_tokens), sum(output_tokens), sum(cached_tokens)))


class EventStream:
    """The chunks of a streaming response. `aclose()` cancels every request behind it, even when
    iteration never started (a client that hung up before the first chunk)."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], streams: list[AsyncIterator[GenerationChunk]]) -> None:
        self._events = events
        self._streams = streams

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await _aclose(self._events)
        finally:
            await asyncio.gather(*(_aclose(s) for s in self._streams), return_exceptions=True)


async def _open_all(backend: Backend, requests: Sequence[GenerateRequest]
                    ) -> list[tuple[GenerationChunk, AsyncIterator[GenerationChunk]]]:
    """Start every stream and wait for each admission chunk; if one is refused, close them all."""
    streams = [backend.generate_stream(r).__aiter__() for r in requests]
    try:
        firsts = await _all_or_nothing([_first(s) for s in streams])
    except BaseException:
        await asyncio.gather(*(_aclose(s) for s in streams), return_exceptions=True)
        raise
    return list(zip(firsts, streams))


async def _first(stream: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise APIError("the replica closed the stream before admitting the request", 500, "internal_error") from None


async def _all_or_nothing(coroutines: list[Any]) -> list[Any]:
    """Await all; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _merge(streams: list[AsyncIterator[GenerationChunk]]) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Interleave streams as their chunks arrive. Leaving early cancels and closes all of them."""
    queue: asyncio.Queue[tuple[int, GenerationChunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(_aclose(s) for s in streams), return_exceptions=True)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
