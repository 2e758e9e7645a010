"""An async load generator over the OpenAI completions API (streaming), for any compatible server.

Open loop sends each request at its arrival time whatever the server's state (the only honest way
to measure latency under a given rate); closed loop keeps a fixed number in flight. Every request
is recorded whatever happens to it. A run is bounded by its request count and `max_duration_s`,
after which unsent requests are recorded as not sent and requests in flight are cut off.
Only loopback addresses are accepted unless `allow_remote` is set.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx

from loadtest.results import RequestResult
from loadtest.traces import BenchRequest


@dataclass(slots=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    # Sent as `model`; None lets the server pick its one model.
    model: str | None = None
    # "open": send at arrival times; "closed": keep `concurrency` requests in flight.
    mode: str = "open"
    concurrency: int = 8
    request_timeout_s: float = 600.0
    # Stop sending after this long and cut off what is still running; None: no limit.
    max_duration_s: float | None = None
    allow_remote: bool = False
    # Sampling of the server's /metrics for the timeline plot; 0 turns it off.
    sample_interval_s: float = 0.5
    # Send each request's priority label ("interactive", ...) as `priority`. Off for servers whose
    # `priority` means something else: vLLM takes an int there and refuses our labels.
    send_priority: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode must be open or closed, got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        host = urlparse(self.base_url).hostname
        if host is None:
            raise ValueError(f"base_url {self.base_url!r} has no host")
        if not self.allow_remote and not _is_loopback(host):
            raise ValueError(f"{host} is not a loopback address; pass allow_remote to load a remote server")


@dataclass(slots=True)
class LoadRun:
    results: list[RequestResult]
    # Samples of the server's queue: {"t_s", "num_waiting", "num_running", "kv_usage", "replicas"}.
    timeline: list[dict[str, float]]
    duration_s: float


async def run_load(workload: list[BenchRequest], config: ClientConfig,
                   on_done: Callable[[RequestResult], None] | None = None) -> LoadRun:
    if not workload:
        raise ValueError("empty workload")
    ids = {r.request_id for r in workload}
    if len(ids) != len(workload) or any(r.after_id is not None and r.after_id not in ids for r in workload):
        raise ValueError("request ids must be unique and every after_id must name a request in the workload")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits, timeout=timeout) as client:
        runner = _Runner(client, workload, config, on_done)
        return await runner.run()


class _Runner:
    def __init__(self, client: httpx.AsyncClient, workload: list[BenchRequest], config: ClientConfig,
                 on_done: Callable[[RequestResult], None] | None) -> None:
        self.client = client
        self.config = config
        self.on_done = on_done
        self.results = {r.request_id: RequestResult(r.request_id, r.priority, r.arrival_s,
                                                    prompt_tokens=len(r.prompt_token_ids)) for r in workload}
        self.roots = sorted((r for r in workload if r.after_id is None), key=lambda r: r.arrival_s)
        self.children: dict[str, list[BenchRequest]] = {}
        for r in workload:
            if r.after_id is not None:
                self.children.setdefault(r.after_id, []).append(r)
        self.tasks: set[asyncio.Task] = set()
        self.start = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def run(self) -> LoadRun:
        self.start = time.perf_counter()
        timeline: list[dict[str, float]] = []
        sampler = asyncio.ensure_future(self._sample(timeline)) if self.config.sample_interval_s > 0 else None
        try:
            if self.config.max_duration_s is None:
                await self._drive()
            else:
                try:
                    await asyncio.wait_for(self._drive(), self.config.max_duration_s)
                except (asyncio.TimeoutError, TimeoutError):
                    await self._cut_off()
        finally:
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        for result in self.results.values():
            if result.sent_s is None and result.error is None:
                result.error = "not sent: the run's time limit came first"
        return LoadRun(list(self.results.values()), timeline, self.now())

    async def _drive(self) -> None:
        if self.config.mode == "open":
            for request in self.roots:
                await asyncio.sleep(max(0.0, request.arrival_s - self.now()))
                self._spawn(request)
        else:
            queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
            for request in self.roots:
                queue.put_nowait(request)
            self.queue = queue
            for _ in range(self.config.concurrency):
                self._track(asyncio.ensure_future(self._worker(queue)))
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def _worker(self, queue: asyncio.Queue[BenchRequest]) -> None:
        while not all(r.finish_s is not None or r.error is not None for r in self.results.values()):
            try:
                request = await asyncio.wait_for(queue.get(), 0.05)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            await self._one(request)

    def _spawn(self, request: BenchRequest) -> None:
        self._track(asyncio.ensure_future(self._one(request)))

    def _track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _one(self, request: BenchRequest) -> None:
        result = self.results[request.request_id]
        try:
            await self._send(request, result)
        except asyncio.CancelledError:
            result.error = result.error or "cut off: the run's time limit came first"
            raise
        except Exception as exc:  # a transport failure is a result, not a crash of the run
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.on_done is not None:
                self.on_done(result)
        for child in self.children.get(request.request_id, ()):
            self._follow(child)

    def _follow(self, child: BenchRequest) -> None:
        async def later() -> None:
            await asyncio.sleep(child.arrival_s)  # the think time after the previous turn
            if self.config.mode == "open":
                await self._one(child)
            else:
                self.queue.put_nowait(child)
        self._track(asyncio.ensure_future(later()))

    async def _send(self, request: BenchRequest, result: RequestResult) -> None:
        body: dict[str, Any] = {"prompt": list(request.prompt_token_ids), "max_tokens": request.output_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.config.send_priority:
            body["priority"] = request.priority
        if self.config.model is not None:
            body["model"] = self.config.model
        result.sent_s = self.now()
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = _error_message(await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                self._on_chunk(json.loads(payload), result)
        if result.error is None:
            result.finish_s = self.now()
            if not result.output_tokens:
                result.output_tokens = len(result.chunk_times_s)

    def _on_chunk(self, chunk: dict[str, Any], result: RequestResult) -> None:
        if "error" in chunk:
            result.error = chunk["error"].get("message", "error event")
            return
        if chunk.get("choices"):
            t = self.now()
            if result.first_token_s is None:
                result.first_token_s = t
            result.chunk_times_s.append(t)
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]

    async def _cut_off(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def _sample(self, timeline: list[dict[str, float]]) -> None:
        while True:
            try:
                text = (await self.client.get("/metrics", timeout=5.0)).text
                timeline.append({"t_s": self.now(), **queue_sample(text)})
            except Exception:  # a server without /metrics (or busy) only costs the timeline
                pass
            await asyncio.sleep(self.config.sample_interval_s)


def queue_sample(metrics_text: str) -> dict[str, float]:
    """Sums over replicas of the iterserve queue gauges, from Prometheus text."""
    sums = {"num_waiting": 0.0, "num_running": 0.0, "kv_usage": 0.0, "replicas": 0.0}
    names = {"iterserve_num_requests_waiting": "num_waiting", "iterserve_num_requests_running": "num_running",
             "iterserve_kv_cache_usage_perc": "kv_usage", "iterserve_replicas": "replicas"}
    kv_series = 0
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = names.get(name)
        if key is None or (key == "replicas" and 'state="RUNNING"' not in line):
            continue
        sums[key] += float(line.rsplit(" ", 1)[1])
        kv_series += key == "kv_usage"
    if kv_series:
        sums["kv_usage"] /= kv_series  # a mean over replicas, not a sum of fractions
    return sums


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
