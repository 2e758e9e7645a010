"""The token channel: a replica sends a request's chunks straight to the ingress that called it.

Over Ray Serve a chunk costs a Ray message between the replica and the ingress: serialized in a
thread pool, reported through the replica's core worker, received by the ingress's one, and handed
across two event loops. On two cores that is about a millisecond of CPU a chunk over both
processes (docs/benchmarks.md), and every millisecond is taken from the engine's step. When the
replica runs on the ingress's node, the chunks after the admission chunk go over a plain loopback
TCP connection instead, framed JSON, many requests on one connection:

- The ingress (`TokenChannelServer`) listens on 127.0.0.1 and puts each attempt's address
  (`TokenChannelAddress`: port, node id, the listener's secret, a key per attempt) into the
  request. The replica (`TokenChannelSender`) opens one connection per ingress, which must begin
  with that secret, and writes each chunk as `[key, chunk]`. A frame of an unknown key (an attempt
  the ingress gave up) is dropped.
- Everything else stays on Ray: the call goes through the handle and the request router, errors
  before admission come back as the call's exception, and the replica's generator runs until the
  request ends, so Serve counts the request as ongoing, cancelling the call aborts it, and a replica
  that dies fails the call. The admission chunk says whether the channel carries the rest
  (`via_channel`); a replica on another node, or one that cannot connect, streams over Ray.
- A connection that closes ends every attempt that had chunks on it (`ChannelClosed`); a replica
  that freezes sends nothing, keep-alives included, and the ingress's stall timeout fails it over.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import struct
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from contracts.serving import GenerationChunk, TokenChannelAddress, chunk_from_wire, chunk_to_wire

logger = logging.getLogger(__name__)

# A frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON.
_HEADER = struct.Struct(">I")
# The largest frame either side accepts: a chunk holds one request's tokens and text since the
# last one; a connection that announces more is not ours, and is closed.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# The replica's writes wait for the ingress to read once this much is buffered.
HIGH_WATER_BYTES = 1024 * 1024
# A connection that has not sent the secret this long after it opened is closed: a replica sends it
# at once, and idle strangers must not hold the ingress's sockets.
SECRET_TIMEOUT_S = 5.0


class ChannelClosed(Exception):
    """The connection that carried an attempt's chunks closed before its last chunk."""


def frame(value: Any) -> bytes:
    body = json.dumps(value, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class Inbox:
    """One attempt's chunks, from the channel and from its Ray stream, in arrival order. Items are
    chunks, `ChannelClosed`, Ray's exceptions, or `END_OF_CALL` when the Ray stream ended."""

    __slots__ = ("items", "_waiter", "fed_by", "__weakref__")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # The connection its chunks came over, which tells it when it closes.
        self.fed_by: object | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout_s: float) -> Any:
        """The next item; TimeoutError if none came within timeout_s."""
        if not self.items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self.items:
                raise TimeoutError
        return self.items.popleft()


# What an Inbox holds after the last item of its Ray stream.
END_OF_CALL = object()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TokenChannelServer:
    """The ingress's side: one loopback listener, started on first use in the running event loop,
    and an Inbox per open attempt."""

    def __init__(self, node_id: str, host: str = "127.0.0.1", secret_timeout_s: float = SECRET_TIMEOUT_S) -> None:
        self.node_id = node_id
        self.host = host
        self.secret_timeout_s = secret_timeout_s
        self.secret = secrets.token_hex(16)
        self.port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Future[None] | None = None
        # Why the listener did not start at the last try; attempts stream over Ray meanwhile.
        self.unavailable: str | None = None
        self._inboxes: dict[str, Inbox] = {}
        # Frames accepted and dropped (no such attempt) since start; connections refused.
        self.num_frames = 0
        self.num_dropped = 0
        self.num_refused = 0

    async def open(self) -> tuple[TokenChannelAddress, Inbox] | None:
        """A new attempt's address and the Inbox its chunks arrive in, close(key) when it ends; None
        when the listener could not start (the attempt streams over Ray then)."""
        if self._server is None:
            try:
                await self._start()
            except OSError as exc:
                if not self.unavailable:
                    logger.warning("the token channel is off until a loopback listener starts: %s", exc)
                self.unavailable = str(exc)
                self._starting = None  # the next attempt tries again (a full descriptor table passes)
                return None
            self.unavailable = None
        key = uuid.uuid4().hex
        inbox = Inbox()
        self._inboxes[key] = inbox
        return TokenChannelAddress(self.host, self.port, self.node_id, self.secret, key), inbox

    def close(self, key: str) -> None:
        self._inboxes.pop(key, None)

    @property
    def num_open(self) -> int:
        return len(self._inboxes)

    async def _start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._listen())
        await asyncio.shield(self._starting)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Reader(self), self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def _inbox(self, key: Any) -> Inbox | None:
        inbox = self._inboxes.get(key) if isinstance(key, str) else None
        if inbox is None:
            self.num_dropped += 1
        return inbox


class _Reader(asyncio.Protocol):
    """One replica's connection: a secret first, then [key, chunk] frames."""

    def __init__(self, server: TokenChannelServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.trusted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.deadline = asyncio.get_running_loop().call_later(self.server.secret_timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        if not self.trusted:
            self._refuse()

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        offset = 0
        try:
            while len(buffer) - offset >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, offset)
                if size > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {size} bytes")
                end = offset + _HEADER.size + size
                if len(buffer) < end:
                    break
                value = json.loads(buffer[offset + _HEADER.size:end])
                offset = end
                self._accept(value)
        except (ValueError, TypeError, UnicodeDecodeError):
            self._refuse()
            return
        del buffer[:offset]

    def _accept(self, value: Any) -> None:
        if not self.trusted:
            if not (isinstance(value, str) and hmac.compare_digest(value, self.server.secret)):
                raise ValueError("a connection that did not open with the secret")
            self.trusted = True
            self.deadline.cancel()
            return
        if not (isinstance(value, list) and len(value) == 2):
            raise ValueError("a frame that is not [key, chunk]")
        key, wire = value
        inbox = self.server._inbox(key)
        if inbox is not None:
            inbox.fed_by = self  # before decoding: a bad chunk ends its attempt too
            inbox.put(chunk_from_wire(wire))
            self.server.num_frames += 1

    def _refuse(self) -> None:
        self.server.num_refused += 1
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.cancel()
        for inbox in list(self.server._inboxes.values()):
            if inbox.fed_by is self:
                inbox.put(ChannelClosed("the replica's token channel closed"))


class TokenChannelSender:
    """The replica's side: one connection per ingress listener, opened on first use; None for an
    address on another node or one that does not answer."""

    def __init__(self, node_id: Callable[[], str | None]) -> None:
        self._node_id = node_id
        self._connections: dict[tuple[str, int, str], _Connection] = {}
        self._opening: dict[tuple[str, int, str], asyncio.Future[_Connection | None]] = {}

    async def connect(self, address: TokenChannelAddress | None) -> _Connection | None:
        if address is None or address.node_id != self._node_id():
            return None
        where = (address.host, address.port, address.secret)
        connection = self._connections.get(where)
        if connection is not None and not connection.closed:
            return connection
        opening = self._opening.get(where)
        if opening is None:
            opening = self._opening[where] = asyncio.ensure_future(self._open(where))
            opening.add_done_callback(lambda _: self._opening.pop(where, None))
        return await asyncio.shield(opening)

    async def _open(self, where: tuple[str, int, str]) -> _Connection | None:
        host, port, secret = where
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
        except (OSError, asyncio.TimeoutError):
            return None
        writer.transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)
        connection = _Connection(writer)
        writer.write(frame(secret))
        # Connections to ingresses that went away are dropped here, as new ones open.
        self._connections = {k: c for k, c in self._connections.items() if not c.closed}
        self._connections[where] = connection
        return connection

    def close(self) -> None:
        for connection in self._connections.values():
            try:
                connection.writer.close()
            except RuntimeError:  # its event loop has closed already
                pass
        self._connections.clear()


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    async def send(self, key: str, chunk: GenerationChunk) -> None:
        """Write one chunk; waits while the ingress is HIGH_WATER_BYTES behind. ConnectionError
        once the ingress is gone."""
        if self.writer.is_closing():
            raise ConnectionResetError("the ingress's token channel is closed")
        self.writer.write(frame([key, chunk_to_wire(chunk)]))
        await self.writer.drain()
