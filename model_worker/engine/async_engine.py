"""AsyncLLMEngine: an engine loop stepping on its own, streams on the caller's event loop.

The engine loop (model_worker/engine/engine_loop.py) is the step loop alone, fed by the messages of
model_worker/engine/protocol.py. For serving it runs in a process of its own (EngineProcess;
`EngineConfig.engine_process`, the default when the engine is built from a config); an engine
passed in (tests, fakes) runs in a thread (EngineThread). Either way this side does everything
that is not the step, on the event loop: validation that can fail
(tokenizing, length checks, block hashes) before anything is sent, so that a bad request raises at
once and nothing is left behind; the text of each output and its stop strings (OutputProcessor);
the streams. A stop string found here finishes the request in the loop, and the tokens the loop
made meanwhile are dropped, so what a client sees is what the engine alone would have given.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import GenerationChunk
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine.llm_engine import LLMEngine
from model_worker.engine.engine_handles import EngineProcess, EngineThread
from model_worker.engine.engine_loop import engine_info
from model_worker.engine.protocol import (AbortRequest, AddRequest, Alive, Call, CallResult, Dead, EngineCall,
                                          EngineOutput, FailRequest, GetStats, ProtocolError, Rejected,
                                          RequestFinished, RequestProgress, ResetPrefixCache, StepOutputs,
                                          StopRequest)
from model_worker.engine.output_processor import OutputProcessor
from model_worker.sched.request_checks import RequestChecker, RequestRejected, check_request_id_unused


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; every request after that fails with this."""


class RequestFailed(RuntimeError):
    """The engine failed on this request (a step raised on it alone); other requests go on."""


# Queued by next_within()'s timer: "no output came in time". Never an output.
_TICK = object()


class RequestStream:
    """The outputs of one queued request, in order. Closing it before the finished output aborts
    the request in the engine (at the next step boundary) and frees its KV blocks."""

    __slots__ = ("request_id", "loop", "queue", "finished", "num_prompt_tokens", "_owner", "_error",
                 "_num_output_tokens", "_stop")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: "AsyncLLMEngine",
                 num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[GenerationChunk | BaseException | object] = asyncio.Queue()
        self.finished = False
        self.num_prompt_tokens = num_prompt_tokens
        self._owner = owner
        self._error: BaseException | None = None
        # Output tokens the consumer has been given (resumed ones included).
        self._num_output_tokens = 0
        # The stop string that ended the text: the loop has been told, its later tokens are dropped.
        self._stop: str | None = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GenerationChunk:
        if self.finished:
            raise StopAsyncIteration
        if self._error is not None:
            item: GenerationChunk | BaseException | object = self._error
        else:
            try:
                item = await self.queue.get()
                while item is _TICK:  # a next_within() timer that fired after its output came
                    item = await self.queue.get()
            except BaseException:
                self.close()
                raise
        return self._accept(item)

    async def next_within(self, timeout_s: float) -> GenerationChunk | None:
        """The next output, or None if none came within timeout_s; the request stays live (a
        consumer sends keep-alives meanwhile). Raises StopAsyncIteration after the last output.
        The wait is a timer that queues a tick, not a task per output: it costs a heap push."""
        if self.finished or self._error is not None:
            return await self.__anext__()
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not _TICK:  # (a stale tick: an earlier timer that fired late)
                return self._accept(item)
        timer = self.loop.call_later(timeout_s, self.queue.put_nowait, _TICK)
        try:
            item = await self.queue.get()
        except BaseException:
            self.close()
            raise
        finally:
            timer.cancel()
        return None if item is _TICK else self._accept(item)

    def _accept(self, item: GenerationChunk | BaseException) -> GenerationChunk:
        if isinstance(item, BaseException):
            self.finished = True
            self._owner._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self._owner._forget(self.request_id)
        return item

    def ready(self) -> list[GenerationChunk]:
        """Outputs already delivered and not yet taken, without waiting: a consumer that fell
        behind the engine takes them together. Stops after a finished output; an error stays
        queued for the next `__anext__`."""
        taken: list[GenerationChunk] = []
        while not self.finished and self._error is None and not self.queue.empty():
            item = self.queue.get_nowait()
            if item is _TICK:
                continue
            if isinstance(item, BaseException):
                self._error = item  # raised by the next __anext__, after what was taken
                break
            taken.append(item)
            if item.finished:
                self.finished = True
                self._owner._forget(self.request_id)
        return taken

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner._forget(self.request_id)
            self._owner._send(AbortRequest(self.request_id))

    # ---- from the engine loop (on the event loop) ------------------------------------------------

    def _from_engine(self, item: RequestProgress | RequestFinished, outputs: OutputProcessor) -> None:
        """Turn the engine loop's output into the consumer's: text, stop strings, errors."""
        if self.finished:
            return
        chunk = item.to_chunk(self.num_prompt_tokens) if type(item) is RequestProgress else item.to_chunk()
        if chunk.error is not None:
            outputs.remove(self.request_id)
            self.queue.put_nowait(RequestFailed(chunk.error))
            return
        if self._stop is not None:
            if chunk.finished:
                self.queue.put_nowait(self._ended_by_stop(chunk, outputs))
            return  # a token after the stop string: never the consumer's
        try:
            stop = outputs.add_tokens(chunk)
            if chunk.finished:
                outputs.finish(chunk)
        except Exception as exc:  # this request's tokens broke the tokenizer: it alone fails
            message = f"detokenizing this request failed: {type(exc).__name__}: {exc}"
            outputs.remove(self.request_id)
            self._owner._send(FailRequest(self.request_id, message))
            self.queue.put_nowait(RequestFailed(message))
            return
        self._num_output_tokens = chunk.num_output_tokens
        if stop is not None and not chunk.finished:
            self._stop = stop
            self._owner._send(StopRequest(self.request_id, stop))
        self.queue.put_nowait(chunk)

    def _ended_by_stop(self, chunk: GenerationChunk, outputs: OutputProcessor) -> GenerationChunk:
        """The loop's finished output after a stop string: without the tokens made after it, in
        its counts and its token times."""
        outputs.remove(self.request_id)
        num_extra = chunk.num_output_tokens - self._num_output_tokens
        timings = chunk.timings
        if num_extra > 0 and timings is not None and len(timings.token_times_s) >= num_extra:
            del timings.token_times_s[len(timings.token_times_s) - num_extra:]
            if timings.token_times_s:
                timings.finished_s = timings.token_times_s[-1]
        return GenerationChunk(self.request_id, finished=True, finish_reason="stop", stop_reason=self._stop,
                               num_prompt_tokens=chunk.num_prompt_tokens, num_output_tokens=self._num_output_tokens,
                               num_cached_tokens=chunk.num_cached_tokens, timings=timings)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 liveness_clock: Callable[[], float] = time.monotonic, **engine_kwargs: Any) -> None:
        config = config or EngineConfig()
        self._liveness_clock = liveness_clock
        # When the engine loop last began a step or an idle tick, on the liveness clock.
        self._alive_s = liveness_clock()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stopped = False
        self._error: BaseException | None = None
        # The engine, when it lives in this process (tests reach its scheduler and runner).
        self.engine: LLMEngine | None = None
        if engine is None and not engine_kwargs and config.engine_process:
            self._engine_loop: EngineThread | EngineProcess = EngineProcess(config, self._on_engine_message)
            self.info = self._engine_loop.info
            tokenizer = self._engine_loop.tokenizer
        else:
            engine = engine if engine is not None else LLMEngine(config, **engine_kwargs)
            self.engine = engine
            self.info = engine_info(engine)
            tokenizer = engine.tokenizer
            # The loop turns the engine's text off: the streams make it (OutputProcessor, below).
            self._engine_loop = EngineThread(engine, self._on_engine_message, liveness_clock)
        self.tokenizer = tokenizer
        self.checks = RequestChecker(tokenizer, self.info.vocab_size, self.info.limits)
        self.outputs = OutputProcessor(tokenizer)

    @property
    def limits(self) -> SchedulerConfig:
        """What the engine runs under (max_num_seqs, max_model_len, KV blocks and block size)."""
        return self.info.limits

    @property
    def vocab_size(self) -> int | None:
        return self.info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.info.eos_token_ids

    @property
    def load_times_s(self) -> dict[str, float]:
        """Seconds each part of loading the model took (imports, weights, tokenizer, KV cache)."""
        return self.info.load_times_s

    @property
    def core_pid(self) -> int | None:
        """The engine process's id; None when the loop steps in a thread of this process."""
        return self._engine_loop.pid if isinstance(self._engine_loop, EngineProcess) else None

    @property
    def is_running(self) -> bool:
        return self._engine_loop.is_alive() and self._error is None and not self._stopped

    def seconds_since_alive(self) -> float:
        """Seconds since the engine loop last began a step, ticked idle, or beat inside a step
        whose model made progress (engine_loop.HEARTBEAT_S): about a step's time, or a heartbeat's,
        while it works; it grows while a step hangs."""
        return max(0.0, self._liveness_clock() - self._alive_s)

    # ---- public API (event loop side) --------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: Priority | str | int = Priority.INTERACTIVE,
                    cache_key: str | None = None, resumed_token_ids: Sequence[int] = (),
                    block_hashes: Sequence[int] | None = None) -> RequestStream:
        """Validate and queue a request; iterate the returned stream for its outputs.

        Everything that can fail for a bad request (tokenizing, token ids, length, priority,
        block hashes, a duplicate id) raises here, before anything is queued. Call from the event
        loop. `resumed_token_ids`, `block_hashes`: see LLMEngine.add_request.
        """
        if self._error is not None or self._stopped:
            raise EngineDeadError("the engine is not running") from self._error
        request_id = request_id or uuid.uuid4().hex
        params = params if params is not None else SamplingParams()
        token_ids, resumed, hashes = self.checks.check(prompt, params, resumed_token_ids, block_hashes, cache_key)
        priority = Priority.parse(priority)
        stream = RequestStream(request_id, asyncio.get_running_loop(), self, len(token_ids))
        with self._streams_lock:
            check_request_id_unused(request_id, self._streams)
            self._streams[request_id] = stream
        self.outputs.add(request_id, token_ids, params.stop, resumed)
        # Arrival is stamped here, on the clock every process of the machine shares.
        message = AddRequest(request_id, token_ids, params, priority, time.monotonic(), cache_key, resumed, hashes)
        try:
            self._send(message)
        except ProtocolError as exc:  # a value the pipe cannot carry: refused at the door, like any other
            self._forget(request_id)
            raise RequestRejected(f"this request cannot be sent to the engine process: {exc}") from exc
        return stream

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: Priority | str | int = Priority.INTERACTIVE,
                       cache_key: str | None = None, resumed_token_ids: Sequence[int] = (),
                       block_hashes: Sequence[int] | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream a request's outputs. Leaving the loop early (break, cancel) aborts it."""
        stream = self.add_request(prompt, params, request_id=request_id, priority=priority, cache_key=cache_key,
                                  resumed_token_ids=resumed_token_ids, block_hashes=block_hashes)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _forget(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)
        self.outputs.remove(request_id)

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    async def stats(self, include_block_hashes: bool = False, block_hashes_since: int | None = None) -> EngineStats:
        """A consistent snapshot, taken by the engine loop between two steps (LLMEngine.stats)."""
        return await self._call(GetStats(include_block_hashes, block_hashes_since))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, applied between steps; False (and nothing done) while a
        request is live."""
        return await self._call(ResetPrefixCache())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._engine_loop.shutdown(timeout_s)
        self._fail_everything(EngineDeadError("the engine was shut down"))

    async def _call(self, call: EngineCall) -> Any:
        if self._error is not None or self._stopped:
            raise EngineDeadError("the engine is not running") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (loop, future)
        self._send(Call(call_id, call))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message: Any) -> None:
        self._engine_loop.send(message)

    # ---- from the engine loop (its thread, or the reader of its process) -----------------------

    def _on_engine_message(self, message: EngineOutput) -> None:
        match message:
            case StepOutputs():
                # A step's outputs carry when it began, older than the heartbeats it sent while it ran.
                self._alive_s = max(self._alive_s, message.began_s)
                self._dispatch(message)
            case Alive():
                self._alive_s = max(self._alive_s, message.began_s)
            case CallResult():
                waiting = self._calls.get(message.call_id)
                if waiting is not None:
                    error = None if message.error is None else message.error.to_exception()
                    _settle(waiting, message.value, error)
            case Rejected():
                self._deliver_error(message.request_id, message.error.to_exception())
            case Dead():
                if not self._stopped:
                    self._error = EngineDeadError(message.message)
                    self._fail_everything(EngineDeadError(message.message))

    def _dispatch(self, step: StepOutputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestProgress | RequestFinished]]] = {}
        with self._streams_lock:
            for outputs in (step.progress, step.finished):
                for item in outputs:
                    stream = self._streams.get(item.request_id)
                    if stream is not None:
                        by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items, self.outputs)
            except RuntimeError:  # that loop is closed: its consumers are gone
                for stream, _ in items:
                    self._send(AbortRequest(stream.request_id))

    def _fail_everything(self, error: EngineDeadError) -> None:
        """No stream and no call may wait forever on an engine loop that stopped."""
        with self._streams_lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver_error(request_id, error)
        for waiting in list(self._calls.values()):
            _settle(waiting, None, error)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            except RuntimeError:
                pass


def _deliver_all(items: list[tuple[RequestStream, RequestProgress | RequestFinished]],
                 outputs: OutputProcessor) -> None:
    for stream, item in items:
        stream._from_engine(item, outputs)


def _settle(waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future], result: Any,
            error: BaseException | None) -> None:
    loop, future = waiting
    try:
        loop.call_soon_threadsafe(_set_future, future, result, error)
    except RuntimeError:  # its loop is closed
        pass


def _set_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
