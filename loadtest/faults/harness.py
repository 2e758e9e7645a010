"""Tools of the fault benchmarks (bench_chaos, cancel_storm, soak): real faults on real replica
processes, and a streaming client that records what a user saw, stalls included.

Replicas are found through LLMServer's `ready()` (its pid), on this machine: the benchmarks run a
local Ray. A fault is a signal to that process: SIGKILL (the replica is gone), SIGSTOP (frozen:
alive to the OS and to Ray, silent to everyone).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class StreamOutcome:
    """One streamed completion as the client saw it."""

    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    # The error event or error body, if one came.
    error: dict[str, Any] | None = None
    # The longest time between two consecutive bytes of the response (from sending to the first,
    # then between events): how long a client looked at a silent stream.
    max_gap_s: float = 0.0
    elapsed_s: float = 0.0
    # No end of stream before the client's deadline.
    hung: bool = False
    # The client's own failure (connection refused or reset), if any.
    transport_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any], deadline_s: float) -> StreamOutcome:
    """POST a streamed completion (usage included); never waits past deadline_s."""
    outcome = StreamOutcome()
    started_s = last_s = time.monotonic()

    async def consume() -> None:
        nonlocal last_s
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = _json_or_text(await response.aread())
                return
            async for line in response.aiter_lines():
                now_s = time.monotonic()
                outcome.max_gap_s = max(outcome.max_gap_s, now_s - last_s)
                last_s = now_s
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = event["error"]
                elif event.get("choices"):
                    choice = event["choices"][0]
                    outcome.text += choice.get("text", "")
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                elif event.get("usage"):
                    outcome.completion_tokens = event["usage"]["completion_tokens"]

    try:
        await asyncio.wait_for(consume(), deadline_s)
    except (asyncio.TimeoutError, TimeoutError):
        outcome.hung = True
    except httpx.HTTPError as exc:
        outcome.transport_error = f"{type(exc).__name__}: {exc}"
    outcome.elapsed_s = time.monotonic() - started_s
    outcome.max_gap_s = max(outcome.max_gap_s, (time.monotonic() - last_s) if outcome.hung else 0.0)
    return outcome


def _json_or_text(raw: bytes) -> dict[str, Any]:
    try:
        return json.loads(raw)
    except ValueError:
        return {"body": raw[:500].decode(errors="replace")}


@dataclass(slots=True)
class Replica:
    replica_id: str
    pid: int


@dataclass(slots=True)
class FaultLog:
    """What was done to which replica, when (seconds from the start of the run)."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, t_s: float, kind: str, replica: Replica) -> None:
        self.events.append({"t_s": round(t_s, 3), "fault": kind, "replica": replica.replica_id, "pid": replica.pid})

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e["fault"] == kind)


def live_replicas(app_name: str, timeout_s: float = 2.0) -> list[Replica]:
    """The LLMServer replicas that answer `ready()` within timeout_s each (a frozen one does not)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name)
    response = handle.broadcast("ready")
    try:  # each replica on its own: Ray's results() loses every reply to one silent replica
        results = response._fetch_replica_results_sync(timeout_s=10)
    except Exception:  # no replica yet, or the broadcast itself failed
        return []
    replies = []
    for result in results:
        try:
            replies.append(result.get(timeout_s))
        except Exception:  # silent (frozen) or gone
            continue
    return [Replica(r["replica"], r["pid"]) for r in replies
            if isinstance(r, dict) and r.get("engine_running") and "pid" in r]


def wait_for_replicas(app_name: str, count: int, timeout_s: float) -> list[Replica]:
    deadline_s = time.monotonic() + timeout_s
    while True:
        replicas = live_replicas(app_name)
        if len(replicas) >= count:
            return replicas
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"only {len(replicas)} of {count} replicas ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def kill(replica: Replica) -> None:
    _signal(replica.pid, signal.SIGKILL)


def freeze(replica: Replica) -> None:
    _signal(replica.pid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # already gone (Serve replaced it)
        pass


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process, from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
