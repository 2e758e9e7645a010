"""OpenAIService: the completions and chat API over any backend of LLMServer replicas.

The ingress deployment builds one over a Serve handle, tests build one over an LLMServer in the
same process; both are `Backend`s. The service tokenizes once (chat templates through the
tokenizer's `apply_chat_template`), checks every prompt against the context before any is sent,
computes block hashes with the engine's own function, and shapes OpenAI responses.

A streaming call returns only once every prompt was admitted, so a refusal is still an HTTP status;
after that, errors arrive in the stream. Closing the returned iterator early (a client that hung
up) cancels every request it started, and their engines free the KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments import openai_protocol as oai
from deployments.errors import APIError, invalid
from deployments.metrics import Exposition, by_label
from model_worker.sched.hashing import hash_prompt_blocks


class Backend(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerationChunk: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]: ...

    async def health(self) -> tuple[bool, dict[str, Any]]: ...

    async def metrics_snapshots(self) -> list[dict[str, Any]]: ...

    async def replica_states(self) -> dict[str, int]: ...


# Prompts of up to this many characters in all are tokenized on the event loop (about a
# millisecond); longer ones in the tokenizer thread, so that no other request waits on them.
INLINE_TOKENIZE_CHARS = 4096
# Characters per token assumed when the tokenizer cannot list its vocabulary.
DEFAULT_MAX_CHARS_PER_TOKEN = 64


class OpenAIService:
    def __init__(self, backend: Backend, tokenizer: Any, info: ModelInfo, ingress_id: str = "ingress") -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.info = info
        self.ingress_id = ingress_id
        # (endpoint, status code) -> responses sent by this ingress replica.
        self.http_responses: dict[tuple[str, int], int] = {}
        # No token covers more characters than the vocabulary's longest entry, so a prompt longer
        # than max_model_len of them cannot fit the context: it is refused before tokenizing (a
        # 10 MB prompt took 14 s to tokenize and then was refused anyway).
        self.max_prompt_chars = info.max_model_len * _max_chars_per_token(tokenizer)
        # One thread: a fast tokenizer is not safe to call from two threads at once.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iterserve-tokenize")

    # ---- the API ------------------------------------------------------------------------------

    async def create(self, kind: str, body: Any) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """A response dict, or for `stream: true` an iterator of chunk dicts (already admitted)."""
        parse = oai.parse_chat if kind == "chat" else oai.parse_completion
        parsed = parse(body, self.info.served_model_name)
        requests = await self._tokenize(parsed)
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

    # ---- requests -----------------------------------------------------------------------------

    async def _tokenize(self, parsed: oai.ParsedRequest) -> list[GenerateRequest]:
        """The requests' token ids, off the event loop unless the text is short."""
        num_chars = self._check_sizes(parsed)
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return self._generate_requests(parsed)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._generate_requests, parsed)

    def _check_sizes(self, parsed: oai.ParsedRequest) -> int:
        """Characters of text to tokenize; a prompt that cannot fit the context is refused here."""
        limit = self.max_prompt_chars
        if parsed.kind == "chat":
            num_chars = sum(len(m["content"]) + len(m.get("name", "")) for m in parsed.messages)
            sizes = [num_chars]
        else:
            sizes = [len(p) for p in parsed.prompts if isinstance(p, str)]
            num_chars = sum(sizes)
        too_long = next((n for n in sizes if n > limit), None)
        if too_long is not None:
            raise invalid("messages" if parsed.kind == "chat" else "prompt",
                          f"this model's maximum context length is {self.info.max_model_len} tokens, and a text of "
                          f"{too_long} characters is longer than that many tokens of this tokenizer can be "
                          f"(at most {limit} characters)", "context_length_exceeded")
        return num_chars

    def _generate_requests(self, parsed: oai.ParsedRequest) -> list[GenerateRequest]:
        """Token ids, max_tokens and block hashes for every prompt; raises before any is sent."""
        if parsed.kind == "chat":
            prompts: list[list[int]] = [self._chat_token_ids(parsed)]
            param = "messages"
        else:
            prompts = [self._encode(p) for p in parsed.prompts]
            param = "prompt"
        requests = []
        for index, token_ids in enumerate(prompts):
            max_tokens = self._max_tokens(parsed, len(token_ids), param)
            request = GenerateRequest(prompt_token_ids=token_ids, params=parsed.sampling_params(max_tokens),
                                      priority=parsed.priority, request_id=f"{parsed.request_id}-{index}")
            # Hashed once, here, with the request's cache key: the router scores replicas by these,
            # and the replica's cache uses them as sent (LLMEngine.check_block_hashes).
            request.block_hashes = hash_prompt_blocks(token_ids, self.info.block_size, request.cache_key)
            requests.append(request)
        return requests

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = prompt
            vocab = self.info.vocab_size
            bad = next((t for t in token_ids if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})", "invalid_token_id")
        if not token_ids:
            raise invalid("prompt", "the prompt is empty after tokenizing", "empty_prompt")
        return token_ids

    def _chat_token_ids(self, parsed: oai.ParsedRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(parsed.messages, tokenize=False,
                                                      add_generation_prompt=parsed.add_generation_prompt)
        except Exception as exc:  # a template may refuse a conversation (roles out of order, ...)
            raise invalid("messages", f"the chat template refused these messages: {exc}") from None
        # The template writes the special tokens (BOS included) itself.
        token_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not token_ids:
            raise invalid("messages", "the conversation is empty after applying the chat template", "empty_prompt")
        return token_ids

    def _max_tokens(self, parsed: oai.ParsedRequest, num_prompt_tokens: int, param: str) -> int:
        limit = self.info.max_model_len
        room = limit - num_prompt_tokens
        if room < 1:
            raise invalid(param, f"this model's maximum context length is {limit} tokens; the prompt has "
                                 f"{num_prompt_tokens}, leaving no room for output", "context_length_exceeded")
        if parsed.max_tokens is None:
            return room
        if parsed.max_tokens > room:
            raise invalid(param, f"this model's maximum context length is {limit} tokens; the request asks for "
                                 f"{num_prompt_tokens + parsed.max_tokens} ({num_prompt_tokens} in the prompt + "
                                 f"{parsed.max_tokens} max_tokens)", "context_length_exceeded")
        return parsed.max_tokens

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


def _max_chars_per_token(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters (byte-level BPE writes one character per byte, so
    this bounds the text one token decodes to)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        vocab = get_vocab() if get_vocab is not None else None
    except Exception:  # a tokenizer that cannot list its vocabulary
        vocab = None
    if not vocab:
        return DEFAULT_MAX_CHARS_PER_TOKEN
    return max(1, max(len(token) for token in vocab))


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
