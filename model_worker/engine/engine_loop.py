"""EngineCore: the step loop alone, fed by messages and answering with messages.

The loop applies what came in (requests to add, abort or stop, calls such as stats), runs a step
when there is work, and emits that step's outputs as one message; idle, it sleeps until a message
or IDLE_TICK_S. It never tokenizes, detokenizes or converts outputs for a wire: the consumer does
(model_worker/engine/async_engine.py), and a progress output crosses as a 4-tuple, not an object.

ThreadCore and ProcessCore, below, are the two ways a consumer runs it, so both ends of the
messages live in this file: a thread of the caller's process, or, for serving, a process of its
own (`main`; started with `python -c`, not `python -m`, under which its classes would belong to
`__main__` and not unpickle on the other side), in the manner of
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
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from contracts.priority import Priority
from contracts.serving import GenerationChunk
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine.llm_engine import LLMEngine
from model_worker.checkpoints.models import load_tokenizer
from model_worker.sched.request_checks import RequestRejected

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
                # Checked by the sender (AsyncLLMEngine.add_request): not scanned again here.
                engine.add_checked_request(request_id, token_ids, params, Priority(priority), arrival_s,
                                           cache_key, resumed, hashes)
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


# ---- how a consumer runs it: a thread of its own process, or a process -----------------------------

class ThreadCore:
    """The engine core in a thread of this process (an engine passed in: tests, fakes)."""

    def __init__(self, engine: LLMEngine, on_message: Callable[[tuple], None], clock: Callable[[], float]) -> None:
        self.core = EngineCore(engine, on_message, clock)
        self.send = self.core.submit
        self._thread = threading.Thread(target=self.core.run, name="iterserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float) -> None:
        self.send(("shutdown",))
        self._thread.join(timeout_s)


_CORE_MAIN = "import sys; from model_worker.engine.engine_loop import main; sys.exit(main(sys.argv))"


class ProcessCore:
    """The engine core in a process of its own (model_worker.engine.engine_loop.main), over a
    socket pair: pickled tuples, one message per step. The constructor returns once the engine is
    built (its EngineInfo in `info`) and raises if it could not be. A reader thread hands every
    message to on_message; the core's end of the pipe closing (it exited, or was killed) is a
    ("dead", why) message. The core exits when this process goes away."""

    def __init__(self, config: EngineConfig, on_message: Callable[[tuple], None]) -> None:
        self._conn, child_conn = Pipe()
        env = dict(os.environ)
        # The core imports what this process imports, wherever Ray put it (a working_dir).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # The core shares the machine with the serving path (this process, the ingress, the HTTP
        # proxy). OpenMP workers that spin between parallel regions take the cores those need, and a
        # region stalls whenever a spinning worker is descheduled: measured on the tiny model on 2
        # cores, 16 streams served at 220 tok/s spinning and 326 tok/s passive (docs/benchmarks.md).
        # An explicit setting of the operator's wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CORE_MAIN, str(child_conn.fileno()), str(os.getpid())],
            pass_fds=(child_conn.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child_conn.close()
        self._send_lock = threading.Lock()
        self._closed = False
        self.send(config)
        # Loaded here while the core loads the model (the core converts an embedded model once,
        # under the model cache's lock, and this waits for it there).
        try:
            self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        except BaseException:
            self._process.kill()
            raise
        self.info: EngineInfo = self._wait_ready()
        self._on_message = on_message
        self._reader = threading.Thread(target=self._read, name="iterserve-core-outputs", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            message = ("failed", f"the engine process exited with code {self._process.wait()} while loading")
        if message[0] != "ready":
            self._process.wait(10)
            raise RuntimeError(f"the engine could not be built: {message[1]}")
        return message[1]

    def send(self, message: Any) -> None:
        """Never raises: a core that is gone is reported by the reader."""
        with self._send_lock:
            if self._closed:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                pass

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                code = self._process.wait()
                self._on_message(("dead", f"the engine process exited with code {code}"))
                return
            self._on_message(message)

    def is_alive(self) -> bool:
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        return self._process.pid

    def shutdown(self, timeout_s: float) -> None:
        self.send(("shutdown",))
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        with self._send_lock:
            self._closed = True
            self._conn.close()


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
