"""The ingress app against Ray Serve's own disconnect exception (ray imported: not a unit test)."""

from __future__ import annotations

import asyncio
import json

from ray.exceptions import TaskCancelledError

from tests.unit.deployments.test_hostile_input import run, served  # noqa: F401  (served is a fixture)


def test_a_receive_that_raises_on_hang_up_ends_the_stream_quietly(served):
    """Ray Serve's ASGI bridge raises TaskCancelledError from receive() when the client hangs up
    mid-stream. The app ends normally, with no traceback logged for the disconnect, and the
    request is aborted in its engine."""
    client, _ = served
    app = client._transport.app
    body = json.dumps({"prompt": "hang up on me", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    sent: list[dict] = []
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        while not any(m.get("type") == "http.response.body" and m.get("body") for m in sent):
            await asyncio.sleep(0.01)
        raise TaskCancelledError()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    run(asyncio.wait_for(app(scope, receive, send), 10))  # returns: nothing escapes
    assert sent[0]["status"] == 200
