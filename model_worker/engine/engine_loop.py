"""EngineLoop: the step loop alone, fed by messages and answering with messages.

The loop applies what came in (requests to add, abort or stop, calls such as stats), runs a step
when there is work, and emits that step's outputs as one StepOutputs message; idle, it sleeps until
a message or IDLE_TICK_S and emits Alive. A step still running after HEARTBEAT_S says so each
HEARTBEAT_S with an Alive of its own, as long as the model has made progress since the last one (a
layer of its forward finished, `runner.progress`): a slow step, a full token budget of prompts on a
slow CPU, never looks like a stuck one to the consumer, and a step stuck in one call falls silent.
It never tokenizes, detokenizes or converts outputs for
a wire: its consumer does (model_worker/engine/async_engine.py). The messages are the structs of
model_worker/engine/protocol.py; a consumer runs the loop in a thread of its own process or in a
process of its own (model_worker/engine/engine_handles.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from contracts.serving import GenerationChunk
from model_worker.engine.llm_engine import LLMEngine
from model_worker.engine.protocol import (NOT_RUNNING, AbortRequest, AddRequest, Alive, Call, CallResult, Dead,
                                          EngineCall, EngineError, EngineInfo, EngineOutput, FailRequest, GetStats,
                                          Rejected, RequestFinished, RequestProgress, ResetPrefixCache, Shutdown,
                                          StepOutputs, StopRequest)

# An idle loop still wakes this often and says so, so that its consumer tells an idle engine from
# a stuck one.
IDLE_TICK_S = 0.5
# A step that runs longer says it is alive this often while its model makes progress. The
# consumer's stall threshold (deployments/llm_server.py, ENGINE_STALL_S) is several of these.
HEARTBEAT_S = 1.0


def engine_info(engine: LLMEngine) -> EngineInfo:
    return EngineInfo(vocab_size=engine.vocab_size, eos_token_ids=engine.scheduler.eos_token_ids,
                      limits=engine.scheduler.config, load_times_s=dict(engine.runner.load_times_s))


def step_outputs(began_s: float, outputs: list[GenerationChunk]) -> StepOutputs:
    """A step's GenerationChunks as one message: most are one token of a running request."""
    progress: list[RequestProgress] = []
    finished: list[RequestFinished] = []
    for out in outputs:
        if out.finished:
            finished.append(RequestFinished.of(out))
        else:
            progress.append(RequestProgress(out.request_id, out.token_ids, out.num_output_tokens,
                                            out.num_cached_tokens, out.logprobs, out.prompt_logprobs))
    return StepOutputs(began_s, progress, finished)


class EngineLoop:
    """Drain the inbox, step, emit; until Shutdown or an error that leaves the engine unable to
    step. `emit` is called once per message out, one call at a time: on the loop's thread, and on
    its heartbeat thread for the Alive of a long step."""

    def __init__(self, engine: LLMEngine, emit: Callable[[EngineOutput], None],
                 clock: Callable[[], float] = time.monotonic, heartbeat_s: float | None = None) -> None:
        # The consumer makes the text: a running request's output is then its token ids and counts
        # alone (a RequestProgress), never text.
        engine.detokenize = False
        self.engine = engine
        self._emit = emit
        # The heartbeat thread emits too: one message at a time through `emit`.
        self._emit_lock = threading.Lock()
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        # When the step now running began; None between steps.
        self._step_began_s: float | None = None
        self._done = threading.Event()
        self.clock = clock
        self._inbox: deque[Any] = deque()
        self._wakeup = threading.Event()
        self._stopped = False
        # Set from another thread (an unreadable message came): the loop dies with it.
        self._fatal: str | None = None

    def emit(self, message: EngineOutput) -> None:
        with self._emit_lock:
            self._emit(message)

    def submit(self, message: Any) -> None:
        """Queue a message for the loop; safe from any thread."""
        self._inbox.append(message)
        self._wakeup.set()

    def die(self, reason: str) -> None:
        """Stop the loop with an error, from any thread: it emits Dead(reason) after the current
        step. For a message that could not be read, whose sender would otherwise wait forever."""
        self._fatal = reason
        self._wakeup.set()

    def run(self) -> None:
        """Until Shutdown, or an error that leaves the engine unable to step: then it emits Dead
        and returns. Every message is answered or applied before it returns."""
        engine = self.engine
        threading.Thread(target=self._beat, name="iterserve-engine-heartbeat", daemon=True).start()
        try:
            while not self._stopped:
                began_s = self.clock()
                self._apply_inbox()
                if self._fatal is not None:
                    self.emit(Dead(self._fatal))
                    break
                if self._stopped:
                    break
                if not engine.has_unfinished():
                    self.emit(Alive(began_s))
                    self._wakeup.wait(IDLE_TICK_S)
                    self._wakeup.clear()
                    continue
                self._step_began_s = began_s
                outputs = engine.step()
                self._step_began_s = None
                self.emit(step_outputs(began_s, outputs))
        except BaseException as exc:  # the loop must never die silently
            self._stopped = True
            self.emit(Dead(f"engine step failed: {type(exc).__name__}: {exc}"))
        finally:
            self._stopped = True
            self._step_began_s = None
            self._done.set()
            self._apply_inbox()  # calls made meanwhile are answered (an error), none left waiting

    def _beat(self) -> None:
        """Every heartbeat_s until the loop ends: Alive, when the step running now ran through the
        last beat too and the model has made progress since (runner.progress changed)."""
        seen: tuple[float, int] | None = None  # (the step's start, its progress) at the last beat
        while not self._done.wait(self.heartbeat_s):
            began_s = self._step_began_s
            if began_s is None:
                seen = None
                continue
            progress = self.engine.runner.progress
            if seen is not None and seen[0] == began_s and seen[1] != progress and not self._stopped:
                self.emit(Alive(self.clock()))
            seen = (began_s, progress)

    def _apply_inbox(self) -> None:
        while self._inbox:
            self._apply(self._inbox.popleft())

    def _apply(self, message: Any) -> None:
        engine = self.engine
        match message:
            case AddRequest():
                self._add(message)
            case AbortRequest():
                engine.abort(message.request_id)
            case StopRequest():
                engine.stop(message.request_id, message.stop_reason)
            case FailRequest():
                engine.fail(message.request_id, message.message)
            case Call():
                self._call(message)
            case Shutdown():
                self._stopped = True
            case _:
                raise TypeError(f"not a message the engine loop takes: {type(message).__name__}")

    def _add(self, message: AddRequest) -> None:
        if self._stopped:
            self.emit(Rejected(message.request_id, NOT_RUNNING))
            return
        try:
            # Checked by the sender (AsyncLLMEngine.add_request): not scanned again here.
            self.engine.add_checked_request(
                message.request_id, message.prompt_token_ids, message.params, message.priority, message.arrival_s,
                message.cache_key, message.resumed_token_ids, message.block_hashes)
        except Exception as exc:
            self.emit(Rejected(message.request_id, EngineError.of(exc)))

    def _call(self, message: Call) -> None:
        if self._stopped:
            self.emit(CallResult(message.call_id, error=NOT_RUNNING))
            return
        try:
            value = _answer(self.engine, message.call)
        except Exception as exc:
            self.emit(CallResult(message.call_id, error=EngineError.of(exc)))
        else:
            self.emit(CallResult(message.call_id, value))


def _answer(engine: LLMEngine, call: EngineCall) -> Any:
    """What a consumer may call between steps (a Call names one of these; nothing else runs)."""
    match call:
        case GetStats():
            return engine.stats(call.include_block_hashes, call.block_hashes_since)
        case ResetPrefixCache():
            return engine.reset_prefix_cache()
    raise TypeError(f"not a call the engine loop answers: {type(call).__name__}")
