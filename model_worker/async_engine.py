"""AsyncLLMEngine: the step loop in its own thread, streams on the caller's event loop.

The event loop never waits on torch: requests, aborts and stats queries are commands that the
engine thread applies between steps, and each step's outputs reach the loop in one
call_soon_threadsafe. Validation that can fail (tokenizing, length checks) runs in the caller
before anything is queued, so a bad request raises at once and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from contracts.engine_stats import EngineStats
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import GenerationChunk
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine import LLMEngine
from model_worker.scheduler import RequestRejected


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; every request after that fails with this."""


class RequestFailed(RuntimeError):
    """The engine failed on this request (a step raised on it alone); other requests go on."""


# Queued by next_within()'s timer: "no output came in time". Never an output.
_TICK = object()


class RequestStream:
    """The outputs of one queued request, in order. Closing it before the finished output aborts
    the request in the engine (at the next step boundary) and frees its KV blocks."""

    __slots__ = ("request_id", "loop", "queue", "finished", "_owner", "_error")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: "AsyncLLMEngine") -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[GenerationChunk | BaseException | object] = asyncio.Queue()
        self.finished = False
        self._owner = owner
        self._error: BaseException | None = None

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
            self._owner._submit(lambda: self._owner.engine.abort(self.request_id))


# An idle engine thread still wakes this often, so that `seconds_since_alive` tells an idle engine
# from a stuck one.
IDLE_TICK_S = 0.5


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 liveness_clock: Callable[[], float] = time.monotonic, **engine_kwargs: Any) -> None:
        self.engine = engine if engine is not None else LLMEngine(config, **engine_kwargs)
        self._liveness_clock = liveness_clock
        # When the engine thread last began a loop iteration (a step, or an idle tick).
        self._alive_s = liveness_clock()
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def limits(self) -> SchedulerConfig:
        """What the engine runs under (max_num_seqs, max_model_len, KV blocks and block size):
        fixed once it is built, so readable from any thread."""
        return self.engine.scheduler.config

    @property
    def vocab_size(self) -> int | None:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.scheduler.eos_token_ids

    @property
    def load_times_s(self) -> dict[str, float]:
        """Seconds each part of loading the model took (weights, tokenizer, KV cache)."""
        return self.engine.runner.load_times_s

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def seconds_since_alive(self) -> float:
        """Seconds since the engine thread last started a step or an idle tick: at most a step's
        time (or IDLE_TICK_S) while it works; it grows while a step hangs."""
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
        token_ids = self.engine.tokenize(prompt)
        resumed = self.engine.check_resumed(resumed_token_ids, params)
        hashes = self.engine.check_block_hashes(block_hashes, token_ids, cache_key)
        self.engine.scheduler.check_fits(len(token_ids), params.max_tokens)
        priority = Priority.parse(priority)
        stream = RequestStream(request_id, asyncio.get_running_loop(), self)
        with self._streams_lock:
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use",
                                      code="duplicate_request_id", param="request_id")
            self._streams[request_id] = stream
        arrival_s = self.engine.clock()

        def add() -> None:
            try:
                self.engine.add_request(request_id, token_ids, params, priority, arrival_time=arrival_s,
                                        cache_key=cache_key, resumed_token_ids=resumed, block_hashes=hashes)
            except Exception as exc:  # a rejection here is delivered to the stream, not the loop
                self._deliver_error(request_id, exc)

        self._submit(add)
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

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    async def stats(self, include_block_hashes: bool = False) -> EngineStats:
        """A consistent snapshot, taken by the engine thread between two steps."""
        return await self._call(lambda: self.engine.stats(include_block_hashes))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, applied between steps; False (and nothing done) while a
        request is live."""
        return await self._call(self.engine.reset_prefix_cache)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self._error is not None or self._stopped:
            raise EngineDeadError("the engine is not running") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as exc:
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(run)
        return await future

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._alive_s = self._liveness_clock()
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(IDLE_TICK_S)
                    self._wakeup.clear()
                    continue
                self._dispatch(self.engine.step())
        except BaseException as exc:  # the loop must never die silently
            self._error = exc
            self._fail_open_streams(EngineDeadError(f"engine step failed: {exc!r}"))
        finally:
            self._apply_commands()
            self._fail_open_streams(EngineDeadError("the engine was shut down"))

    def _fail_open_streams(self, error: EngineDeadError) -> None:
        """No stream may wait forever on an engine that stopped."""
        with self._streams_lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver_error(request_id, error)

    def _apply_commands(self) -> None:
        while self._commands:
            self._commands.popleft()()

    def _dispatch(self, outputs: list[GenerationChunk]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, GenerationChunk]]] = {}
        with self._streams_lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its consumers are gone
                for _, out in items:
                    if not out.finished:
                        self.engine.abort(out.request_id)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            except RuntimeError:
                pass


def _put_all(items: list[tuple[RequestStream, GenerationChunk]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(RequestFailed(out.error) if out.error is not None else out)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
