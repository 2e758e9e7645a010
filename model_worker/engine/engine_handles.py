"""The two ways a consumer runs an EngineLoop: EngineThread and EngineProcess.

Both take the loop's messages (model_worker/engine/protocol.py) through `send` and hand every
message the loop emits to `on_message`; neither says anything about what the messages mean.

EngineThread runs the loop in a thread of the caller's process (an engine passed in: tests,
fakes): the structs are handed over as they are. EngineProcess runs it in a process of its own
(model_worker/engine/engine_process_main.py, started with `python -c`: under `python -m` its
module would be `__main__`), in the manner of vLLM v1's engine core process: the replica's event
loop, Ray's streaming and the detokenizer then run beside the step, not between two steps under
one GIL. Each message crosses the pipe as the bytes of one EngineCodec encoding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing import Pipe
from typing import Any

from model_worker.checkpoints.models import load_tokenizer
from model_worker.config import EngineConfig
from model_worker.engine.engine_loop import EngineLoop
from model_worker.engine.llm_engine import LLMEngine
from model_worker.engine.protocol import (Dead, EngineCodec, EngineInfo, EngineOutput, LoadFailed, ProtocolError,
                                          Ready, Shutdown, StartEngine)


class EngineThread:
    """The engine loop in a thread of this process."""

    def __init__(self, engine: LLMEngine, on_message: Callable[[EngineOutput], None],
                 clock: Callable[[], float]) -> None:
        self.loop = EngineLoop(engine, on_message, clock)
        self.send = self.loop.submit
        self._thread = threading.Thread(target=self.loop.run, name="iterserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float) -> None:
        self.send(Shutdown())
        self._thread.join(timeout_s)


_PROCESS_MAIN = ("import sys; from model_worker.engine.engine_process_main import main; "
                 "sys.exit(main(sys.argv))")


class EngineProcess:
    """The engine loop in a process of its own, over a socket pair. The constructor returns once
    the engine is built (its EngineInfo in `info`) and raises if it could not be. A reader thread
    decodes every message and hands it to on_message; the process's end of the pipe closing (it
    exited, or was killed) or bytes that are no message are a Dead message. The process exits when
    this one goes away."""

    def __init__(self, config: EngineConfig, on_message: Callable[[EngineOutput], None]) -> None:
        self._codec = EngineCodec(EngineOutput)
        self._conn, child_conn = Pipe()
        env = dict(os.environ)
        # The process imports what this process imports, wherever Ray put it (a working_dir).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # OpenMP's wait policy is the runtime's own unless the operator sets one: with SmolLM2, a
        # passive team (workers asleep between parallel regions) made the served decode step 30%
        # slower than spinning workers do, the serving processes' share of the cores included
        # (docs/benchmarks.md, 'Decode steps at the memory limit').
        self._process = subprocess.Popen(
            [sys.executable, "-c", _PROCESS_MAIN, str(child_conn.fileno()), str(os.getpid())],
            pass_fds=(child_conn.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child_conn.close()
        self._send_lock = threading.Lock()
        self._closed = False
        try:
            self.send(StartEngine(config))
            # Loaded here while the process loads the model (it converts an embedded model once,
            # under the model cache's lock, and this waits for it there).
            self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        except BaseException:
            self._process.kill()
            self._process.wait()
            raise
        self.info: EngineInfo = self._wait_ready()
        self._on_message = on_message
        self._reader = threading.Thread(target=self._read, name="iterserve-engine-outputs", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        try:
            message: Any = self._codec.decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            message = LoadFailed(f"the engine process exited with code {self._process.wait()} while loading")
        except ProtocolError as exc:
            self._process.kill()
            message = LoadFailed(str(exc))
        if isinstance(message, Ready):
            return message.info
        if not isinstance(message, LoadFailed):
            self._process.kill()
            message = LoadFailed(f"the engine process sent a {message.kind.value} message before it was ready")
        self._process.wait(10)
        raise RuntimeError(f"the engine could not be built: {message.message}")

    def send(self, message: Any) -> None:
        """Raises ProtocolError for a message the codec cannot carry (an int beyond 64 bits), and
        never for a process that is gone: the reader reports that."""
        data = self._codec.encode(message)
        with self._send_lock:
            if self._closed:
                return
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                pass

    def _read(self) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                code = self._process.wait()
                self._on_message(Dead(f"the engine process exited with code {code}"))
                return
            try:
                message = self._codec.decode(data)
            except ProtocolError as exc:  # nothing it sends can be trusted after this
                self._process.kill()
                self._on_message(Dead(f"the engine process sent a message this side cannot read: {exc}"))
                return
            self._on_message(message)

    def is_alive(self) -> bool:
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        return self._process.pid

    def shutdown(self, timeout_s: float) -> None:
        self.send(Shutdown())
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        with self._send_lock:
            self._closed = True
            self._conn.close()
