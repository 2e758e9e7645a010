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
from typing import Any

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments import openai_protocol as oai
from deployments.backend import Backend
from deployments.errors import APIError, rejected
from deployments.metrics import IngressMetrics, render_ingress_metrics
from deployments.openai_models import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, validate
from deployments.request_builder import RequestBuilder
from model_worker.sched.request_checks import RequestRejected, check_token_ids


class OpenAIService:
    def __init__(self, backend: Backend, tokenizer: Any, info: ModelInfo, ingress_id: str = "ingress") -> None:
        self.backend = backend
        self.info = info
        self.ingress_id = ingress_id
        self.requests = RequestBuilder(tokenizer, info)
        self.tokenizer = tokenizer
        # Token id -> its text alone, for logprobs (at most the vocabulary's size).
        self._token_texts: dict[int, str] = {}
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
            return EventStream(self._stream_events(parsed, streams, requests), [s for _, s in streams])
        return await self._unary(parsed, requests)

    async def tokenize(self, body: Any) -> dict[str, Any]:
        """POST /tokenize: a prompt, or messages with the chat template, as the token ids a
        generation request would send (vLLM's request and response)."""
        model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        request = validate(model, body, self.info.served_model_name)
        token_ids = await self.requests.tokenize(request)
        strs = None
        if request.return_token_strs:
            convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
            strs = list(convert(token_ids)) if convert is not None else [self.token_text(t) for t in token_ids]
        return {"count": len(token_ids), "max_model_len": self.info.max_model_len, "tokens": token_ids,
                "token_strs": strs}

    def detokenize(self, body: Any) -> dict[str, Any]:
        """POST /detokenize: token ids to their text."""
        request = validate(DetokenizeRequest, body, self.info.served_model_name)
        try:
            check_token_ids(request.tokens, self.info.vocab_size, "tokens")
        except RequestRejected as exc:
            raise rejected(exc) from None
        return {"prompt": self.tokenizer.decode(request.tokens)}

    def models(self) -> dict[str, Any]:
        info = self.info
        return {"object": "list", "data": [{"id": info.served_model_name, "object": "model", "created": info.created,
                                            "owned_by": "iterserve", "max_model_len": info.max_model_len}]}

    async def metrics_text(self) -> str:
        """/metrics: what the replicas and this ingress count, gathered now."""
        backend = self.backend
        return render_ingress_metrics(IngressMetrics(
            model_name=self.info.served_model_name, ingress_id=self.ingress_id,
            replicas=await backend.metrics_snapshots(), replica_states=await backend.replica_states(),
            admission=backend.admission_stats(), failover=backend.failover_counters(),
            http_responses=dict(self.http_responses), token_channel=backend.token_channel_counters()))

    def record_response(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.http_responses[key] = self.http_responses.get(key, 0) + 1

    # ---- responses ----------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs name it (a piece of a UTF-8 character decodes to U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, parsed: oai.ParsedRequest, chunk: GenerationChunk, text_offset: int = 0,
                  echoed: list[int] | None = None) -> dict[str, Any] | None:
        """The chunk's tokens' logprobs in the endpoint's shape, after those of the `echoed`
        prompt's tokens when given; None unless the request asked."""
        if parsed.logprobs is None:
            return None
        entries: list[Any] = list(chunk.logprobs or [])
        token_ids = chunk.token_ids[-len(entries):] if entries else []
        if echoed is not None:
            token_ids = [*echoed, *token_ids]
            entries = [*(chunk.prompt_logprobs or [None] * len(echoed)), *entries]
        if parsed.kind == "chat":
            return oai.chat_logprobs(token_ids, entries, self.token_text, parsed.logprobs)
        return oai.completion_logprobs(token_ids, entries, self.token_text, parsed.logprobs, text_offset)

    def _prompt_text(self, parsed: oai.ParsedRequest, index: int) -> str:
        """An echoed prompt: as it was sent, or the text of its token ids."""
        prompt = parsed.prompts[index // parsed.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    async def _unary(self, parsed: oai.ParsedRequest, requests: list[GenerateRequest]) -> dict[str, Any]:
        results = await _all_or_nothing([self.backend.generate(r) for r in requests])
        choices = []
        for i, (request, r) in enumerate(zip(requests, results)):
            echoed = request.prompt_token_ids if parsed.echo else None
            text = self._prompt_text(parsed, i) + r.text if parsed.echo else r.text
            choices.append(oai.choice(parsed, i, text, r.finish_reason, r.stop_reason,
                                      self._logprobs(parsed, r, echoed=echoed)))
        usage = oai.usage(sum(r.num_prompt_tokens for r in results), sum(r.num_output_tokens for r in results),
                          sum(r.num_cached_tokens for r in results))
        return oai.completion_response(parsed, choices, usage)

    async def _stream_events(self, parsed: oai.ParsedRequest,
                             streams: list[tuple[GenerationChunk, AsyncIterator[GenerationChunk]]],
                             requests: list[GenerateRequest]) -> AsyncIterator[dict[str, Any]]:
        prompt_tokens = [first.num_prompt_tokens for first, _ in streams]
        output_tokens = [0] * len(streams)
        cached_tokens = [0] * len(streams)
        # Completions: where each choice's next token starts in its text (logprobs' text_offset).
        text_offsets = [0] * len(streams)
        # Completions with echo: each choice's first chunk carries its prompt first.
        to_echo = [parsed.echo] * len(streams)
        if parsed.kind == "chat":
            for index in range(len(streams)):
                yield oai.stream_chunk(parsed, index, "", role=True)
        async with contextlib.aclosing(_merge([stream for _, stream in streams])) as merged:
            async for index, chunk in merged:
                output_tokens[index] = chunk.num_output_tokens
                cached_tokens[index] = chunk.num_cached_tokens
                text, echoed = chunk.text, None
                if to_echo[index] and (chunk.token_ids or chunk.finished):
                    to_echo[index] = False
                    text, echoed = self._prompt_text(parsed, index) + text, requests[index].prompt_token_ids
                logprobs = (self._logprobs(parsed, chunk, text_offsets[index], echoed)
                            if chunk.logprobs or echoed is not None else None)
                if logprobs is not None and parsed.kind == "completion":
                    text_offsets[index] += sum(map(len, logprobs["tokens"]))
                if text or chunk.finished or logprobs is not None:
                    yield oai.stream_chunk(parsed, index, text, chunk.finish_reason, chunk.stop_reason,
                                           logprobs=logprobs)
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
