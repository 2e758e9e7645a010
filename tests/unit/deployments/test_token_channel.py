"""The token channel over real loopback sockets: frames in any segmentation, the secret, hostile
connections, a closed connection, and the sender's choice of channel."""

from __future__ import annotations

import asyncio
import json

import pytest

from contracts.serving import GenerationChunk, RequestTimings, TokenChannelAddress, chunk_from_wire, chunk_to_wire
from deployments.token_channel import (MAX_FRAME_BYTES, ChannelClosed, Inbox, TokenChannelSender, TokenChannelServer,
                                       frame)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_chunk_crosses_the_wire_unchanged():
    chunk = GenerationChunk("r", "h\u00e9\udc80", [1, 2], True, "stop", 7, 3, 2, 1,
                            RequestTimings(1.0, 2.0, None, 3.0, [1.5, 2.5]), None, "rep")
    assert chunk_from_wire(json.loads(json.dumps(chunk_to_wire(chunk)))) == chunk
    plain = GenerationChunk("r", keepalive=True)
    assert chunk_from_wire(json.loads(json.dumps(chunk_to_wire(plain)))) == plain
    for bad in ({"request_id": "r"}, ["r"], [*chunk_to_wire(plain)[:-1], 1, 2]):
        with pytest.raises(ValueError):
            chunk_from_wire(bad)


async def _raw(server: TokenChannelServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(server.host, server.port)


def test_frames_arrive_whole_however_the_bytes_are_cut():
    async def main():
        server = TokenChannelServer("n")
        (address, inbox), (other, other_inbox) = await server.open(), await server.open()
        reader, writer = await _raw(server)
        data = frame(server.secret) + b"".join(
            frame([key, chunk_to_wire(GenerationChunk("r", str(i), [i]))])
            for i, key in enumerate([address.key, other.key, address.key, "gone"]))
        for i in range(len(data)):  # a byte at a time
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        got = [await inbox.get(1.0), await inbox.get(1.0), await other_inbox.get(1.0)]
        writer.close()
        server.stop()
        return server, got

    server, got = run(main())
    assert [c.text for c in got] == ["0", "2", "1"] and [c.token_ids for c in got] == [[0], [2], [1]]
    assert server.num_frames == 3 and server.num_dropped == 1 and server.num_refused == 0


@pytest.mark.parametrize("opening", [
    frame("not the secret"),
    frame(["key", []]),  # a chunk before the secret
    b"\xff\xff\xff\xff",  # a frame over MAX_FRAME_BYTES
    b"\x00\x00\x00\x03abc",  # not JSON
])
def test_a_connection_that_is_not_a_replica_is_closed_and_delivers_nothing(opening):
    async def main():
        server = TokenChannelServer("n")
        address, inbox = await server.open()
        reader, writer = await _raw(server)
        writer.write(opening + frame([address.key, chunk_to_wire(GenerationChunk("r", "x"))]))
        await writer.drain()
        closed = await reader.read()  # b"" once the ingress closes it
        with pytest.raises(TimeoutError):
            await inbox.get(0.05)
        server.stop()
        return server, closed

    server, closed = run(main())
    assert closed == b"" and server.num_refused == 1 and server.num_frames == 0
    assert MAX_FRAME_BYTES < 0xFFFFFFFF


def test_a_connection_that_sends_no_secret_in_time_is_closed():
    async def main():
        server = TokenChannelServer("n", secret_timeout_s=0.05)
        await server.open()
        reader, writer = await _raw(server)
        closed = await reader.read()
        server.stop()
        return server, closed

    server, closed = run(main())
    assert closed == b"" and server.num_refused == 1


def test_a_frame_that_is_not_key_and_chunk_closes_the_connection():
    async def main():
        server = TokenChannelServer("n")
        address, inbox = await server.open()
        reader, writer = await _raw(server)
        writer.write(frame(server.secret) + frame([address.key, {"text": "x"}]))
        await writer.drain()
        closed = await reader.read()
        server.stop()
        return server, closed, await inbox.get(0.5)

    server, closed, item = run(main())
    assert closed == b"" and server.num_refused == 1
    assert isinstance(item, ChannelClosed)


def test_a_closed_connection_ends_the_attempts_it_fed_and_no_other():
    async def main():
        server = TokenChannelServer("n")
        (fed, fed_inbox), (_, quiet_inbox) = await server.open(), await server.open()
        sender = TokenChannelSender(lambda: "n")
        connection = await sender.connect(fed)
        await connection.send(fed.key, GenerationChunk("r", "a", [5]))
        first = await fed_inbox.get(1.0)
        sender.close()  # as a replica that died
        ended = await fed_inbox.get(1.0)
        with pytest.raises(TimeoutError):
            await quiet_inbox.get(0.05)
        with pytest.raises(ConnectionError):
            await connection.send(fed.key, GenerationChunk("r", "b"))
        server.stop()
        return first, ended

    first, ended = run(main())
    assert first.token_ids == [5] and isinstance(ended, ChannelClosed)


def test_an_attempt_once_closed_is_held_by_nothing():
    import gc
    import weakref

    async def main():
        server = TokenChannelServer("n")
        address, inbox = await server.open()
        sender = TokenChannelSender(lambda: "n")
        connection = await sender.connect(address)
        await connection.send(address.key, GenerationChunk("r", "a"))
        await inbox.get(1.0)
        server.close(address.key)
        held = weakref.ref(inbox)
        del inbox
        gc.collect()
        alive = held() is not None
        sender.close()
        server.stop()
        return alive

    assert not run(main()), "the open connection keeps no finished attempt alive"


def test_a_sender_uses_the_channel_only_on_its_own_node_and_shares_one_connection():
    async def main():
        server = TokenChannelServer("n")
        (a, inbox_a), (b, inbox_b) = await server.open(), await server.open()
        sender = TokenChannelSender(lambda: "n")
        elsewhere = TokenChannelSender(lambda: "other")
        unknown = TokenChannelSender(lambda: None)
        first, second = await asyncio.gather(sender.connect(a), sender.connect(b))
        await first.send(a.key, GenerationChunk("r", "to a"))
        await second.send(b.key, GenerationChunk("r", "to b"))
        got = (await inbox_a.get(1.0)).text, (await inbox_b.get(1.0)).text
        refused = TokenChannelAddress("127.0.0.1", _closed_port(), "n", server.secret, "k")
        others = [await elsewhere.connect(a), await unknown.connect(a), await sender.connect(None),
                  await sender.connect(refused)]
        sender.close()
        server.stop()
        return first is second, got, others

    shared, got, others = run(main())
    assert shared and got == ("to a", "to b")
    assert others == [None, None, None, None]


def test_a_listener_that_cannot_start_leaves_every_attempt_on_ray():
    async def main():
        server = TokenChannelServer("n", host="203.0.113.1")  # an address of no interface here
        return await server.open(), await server.open(), server.unavailable

    first, second, reason = run(main())
    assert first is None and second is None and reason


def test_an_inbox_waits_for_its_next_item_until_its_timeout():
    async def main():
        inbox = Inbox()
        with pytest.raises(TimeoutError):
            await inbox.get(0.01)
        asyncio.get_running_loop().call_later(0.01, inbox.put, "late")
        return await inbox.get(1.0)

    assert run(main()) == "late"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
