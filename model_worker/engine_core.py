"""EngineCore: the step loop alone, fed by messages and answering with messages.

The loop applies what came in (requests to add, abort or stop, calls such as stats), runs a step
when there is work, and emits that step's outputs as one message; idle, it sleeps until a message
or IDLE_TICK_S. It never tokenizes, detokenizes or converts outputs for a wire: the consumer does
(model_worker/async_engine.py), and a progress output crosses as a 4-tuple, not an object.

It runs in a thread of the caller's process, or, for serving, as a process of its own
(`main`, started by async_engine.ProcessCore; not `python -m`, under which its classes would
belong to `__main__` and not unpickle on the other side), in the manner of
vLLM v1's engine core: the replica's event loop, Ray's streaming and the detokenizer then run
beside the step, not between two steps under one GIL. Messages, as tuples:

    in:  ("add", request_id, token_ids, params, priority, arrival_s, cache_key, resumed, hashes)
         ("abort", request_id)   ("stop", request_id, stop_string)   ("fail", request_id, message)
         ("call", call_id, method, args)   ("shutdown",)
    out: ("ready", EngineInfo)  ("failed", message)             (the process, once, at start)
         ("step", began_s, outputs)   ("alive", began_s)        (each step; each idle tick)
         ("result", call_id, ok, value)   ("rejected", request_id, error)   ("dead", message)

`began_s` is when that loop iteration began, on the core's clock (time.monotonic in the
process, which is the same clock in every process of the machine): the consumer's liveness check.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from contracts.serving import GenerationChunk
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine import LLMEngine
from model_worker.request_checks import RequestRejected

# An idle core still wakes this often and says so, so that its consumer tells an idle engine from
# a stuck one.
IDLE_TICK_S = 0.5
# The process checks this often that the process that started it is still there; it exits when
# not (the replica was killed: nothing will ever read its outputs again).
PARENT_CHECK_S = 0.5

# A progress output on the wire: (request_id, token_ids, num_output_tokens, num_cached_tokens).
# Anything else (finished, failed) crosses as the GenerationChunk itself.
ProgressTuple = tuple[str, list[int], int, int]


@dataclass(slots=True)
class EngineInfo:
    """What the consumer needs to know of a built engine: fixed once it is built."""

    vocab_size: int | None
    eos_token_ids: frozenset[int]
    limits: SchedulerConfig
    load_times_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        return cls(vocab_size=engine.vocab_size, eos_token_ids=engine.scheduler.eos_token_ids,
                   limits=engine.scheduler.config, load_times_s=dict(engine.runner.load_times_s))


def pack(outputs: list[GenerationChunk]) -> list[ProgressTuple | GenerationChunk]:
    """A step's outputs for the wire: most are one token of a running request."""
    return [(out.request_id, out.token_ids, out.num_output_tokens, out.num_cached_tokens)
            if not out.finished and out.error is None and not out.text else out
            for out in outputs]


class EngineCore:
    def __init__(self, engine: LLMEngine, emit: Callable[[tuple], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.emit = emit
        self.clock = clock
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._stopped = False

    def submit(self, message: tuple) -> None:
        """Queue a message for the loop; safe from any thread."""
        self._inbox.append(message)
        self._wakeup.set()

    def run(self) -> None:
        """Until a shutdown message, or an error that leaves the engine unable to step: then it
        emits ("dead", why) and returns. Every message is answered or applied before it returns."""
        engine = self.engine
        try:
            while not self._stopped:
                began_s = self.clock()
                self._apply_inbox()
                if self._stopped:
                    break
                if not engine.has_unfinished():
                    self.emit(("alive", began_s))
                    self._wakeup.wait(IDLE_TICK_S)
                    self._wakeup.clear()
                    continue
                self.emit(("step", began_s, pack(engine.step())))
        except BaseException as exc:  # the loop must never die silently
            self._stopped = True
            self.emit(("dead", f"engine step failed: {type(exc).__name__}: {exc}"))
        finally:
            self._stopped = True
            self._apply_inbox()  # calls made meanwhile are answered (an error), none left waiting

    def _apply_inbox(self) -> None:
        while self._inbox:
            self._apply(self._inbox.popleft())

    def _apply(self, message: tuple) -> None:
        kind = message[0]
        engine = self.engine
        if kind == "add":
            _, request_id, token_ids, params, priority, arrival_s, cache_key, resumed, hashes = message
            if self._stopped:
                self.emit(("rejected", request_id, RuntimeError("the engine is not running")))
                return
            try:
                engine.add_request(request_id, token_ids, params, priority, arrival_time=arrival_s,
                                   cache_key=cache_key, resumed_token_ids=resumed, block_hashes=hashes)
            except Exception as exc:
                self.emit(("rejected", request_id, portable(exc)))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "stop":
            engine.stop(message[1], message[2])
        elif kind == "fail":
            engine.fail(message[1], message[2])
        elif kind == "call":
            _, call_id, method, args = message
            if self._stopped:
                self.emit(("result", call_id, False, RuntimeError("the engine is not running")))
                return
            try:
                value = _CALLS[method](engine, *args)
            except Exception as exc:
                self.emit(("result", call_id, False, portable(exc)))
            else:
                self.emit(("result", call_id, True, value))
        elif kind == "shutdown":
            self._stopped = True
        else:
            raise ValueError(f"unknown engine core message {kind!r}")


# What a consumer may call between steps, by name (a message names its method; nothing else runs).
_CALLS: dict[str, Callable[..., Any]] = {
    "stats": LLMEngine.stats,
    "reset_prefix_cache": LLMEngine.reset_prefix_cache,
}


def portable(exc: BaseException) -> BaseException:
    """An error that pickles and unpickles as itself: RequestRejected keeps its code and param,
    anything else becomes a RuntimeError that names it."""
    if isinstance(exc, RequestRejected):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---- the process ---------------------------------------------------------------------------------

def serve_connection(conn: Connection, parent_pid: int) -> int:
    """The engine core process: read the EngineConfig, build the engine, say ready, run the loop
    with a reader thread feeding it. Returns the exit code."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="iterserve-parent-watch",
                     daemon=True).start()
    try:
        config: EngineConfig = conn.recv()
        engine = LLMEngine(config, detokenize=False)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", EngineInfo.of(engine)))
    core = EngineCore(engine, conn.send)
    threading.Thread(target=_read_into, args=(conn, core), name="iterserve-core-inbox", daemon=True).start()
    core.run()
    return 0


def _read_into(conn: Connection, core: EngineCore) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the consumer closed its end: nothing more will come
            core.submit(("shutdown",))
            return
        core.submit(message)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: main([argv0, FD, PARENT_PID]) (AsyncLLMEngine starts it)", file=sys.stderr)
        return 2
    # Ctrl-C in a terminal reaches the whole process group: the consumer shuts the core down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve_connection(Connection(int(argv[1])), int(argv[2]))
