"""The engine process: read a StartEngine, build the engine, say Ready, run the EngineLoop.

Started by EngineProcess (model_worker/engine/engine_handles.py) with the fd of its end of the
pipe and the pid of the process it serves. A reader thread decodes each message into the loop's
inbox; the loop encodes each message it emits and sends it from its own thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from model_worker.engine.engine_loop import EngineLoop, engine_info
from model_worker.engine.llm_engine import LLMEngine
from model_worker.engine.protocol import (EngineCodec, EngineInput, LoadFailed, ProtocolError, Ready, Shutdown,
                                          StartEngine)

# The process checks this often that the process that started it is still there; it exits when
# not (the replica was killed: nothing will ever read its outputs again).
PARENT_CHECK_S = 0.5


def serve_connection(conn: Connection, parent_pid: int) -> int:
    """Returns the exit code."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="iterserve-parent-watch",
                     daemon=True).start()
    codec = EngineCodec(EngineInput)
    try:
        start = codec.decode(conn.recv_bytes())
        if not isinstance(start, StartEngine):
            raise ProtocolError(f"the first message must be {StartEngine.__name__}, not {type(start).__name__}")
        engine = LLMEngine(start.config, detokenize=False)
    except BaseException as exc:
        conn.send_bytes(codec.encode(LoadFailed(f"{type(exc).__name__}: {exc}")))
        return 1
    conn.send_bytes(codec.encode(Ready(engine_info(engine))))
    loop = EngineLoop(engine, lambda message: conn.send_bytes(codec.encode(message)))
    threading.Thread(target=_read_into, args=(conn, codec, loop), name="iterserve-engine-inbox",
                     daemon=True).start()
    loop.run()
    return 0


def _read_into(conn: Connection, codec: EngineCodec, loop: EngineLoop) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the consumer closed its end: nothing more will come
            loop.submit(Shutdown())
            return
        try:
            loop.submit(codec.decode(data))
        except ProtocolError as exc:  # its sender waits for an answer that cannot come
            loop.die(f"a message the engine process cannot read: {exc}")
            return


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: main([argv0, FD, PARENT_PID]) (EngineProcess starts it)", file=sys.stderr)
        return 2
    # Ctrl-C in a terminal reaches the whole process group: the consumer shuts the loop down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve_connection(Connection(int(argv[1])), int(argv[2]))
