"""The ingress's admission stage (IngressAdmission): batch requests get 429 first once requests
wait, a refused request's stream is never opened, the queue is released however a request ends,
a unary request is watched through its stream, and /metrics shows it. A fake server whose streams
hold their first token until the test releases them, behind the real LocalBackend; a fake clock."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.admission import AdmissionPolicy
from contracts.priority import Priority
from contracts.sampling import SamplingParams
from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments.errors import APIError
from deployments.ingress_admission import IngressAdmission
from deployments.local_backend import LocalBackend
from deployments.metrics import ReplicaMetrics
from deployments.openai_service import OpenAIService
from tests.unit.fakes import FakeClock


class HeldServer:
    """An LLMServer whose every stream yields its admission chunk, then waits for `release`
    before two tokens."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent: list[str] = []

    async def model_info(self) -> ModelInfo:
        return ModelInfo("m", 64, 4, 100, [], created=0)

    async def generate_stream(self, request: GenerateRequest):
        self.sent.append(request.request_id)
        yield GenerationChunk(request.request_id)
        await self.release.wait()
        yield GenerationChunk(request.request_id, text="a", token_ids=[1], num_output_tokens=1)
        yield GenerationChunk(request.request_id, text="b", token_ids=[2], finished=True, finish_reason="length",
                              num_output_tokens=2)

    async def metrics_snapshot(self):
        return ReplicaMetrics("r0", "m", [])


def request(rid: str, priority: str = "interactive") -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2), priority=priority, request_id=rid)


def held_backend(policy: AdmissionPolicy, clock: FakeClock) -> tuple[HeldServer, IngressAdmission, LocalBackend]:
    server = HeldServer()
    admission = IngressAdmission(policy, clock)
    return server, admission, LocalBackend(server, admission)


async def first_chunk(admission: IngressAdmission, server: HeldServer, rid: str, priority: str = "interactive"):
    stream = admission.watch(request(rid, priority), server.generate_stream)
    await stream.__anext__()
    return stream


def num_waiting(admission: IngressAdmission) -> int:
    return sum(admission.stats().num_waiting.values())


def test_batch_is_shed_first_and_interactive_only_at_the_hard_limit():
    clock = FakeClock(0.0)
    server, admission, backend = held_backend(AdmissionPolicy(max_waiting_requests=3, batch_max_wait_s=0.5), clock)

    async def main():
        held = [await first_chunk(admission, server, "i0"), await first_chunk(admission, server, "b0", "batch")]
        clock.advance(1.0)  # the oldest request has waited 1 s for a first token
        with pytest.raises(APIError) as batch_refused:
            await first_chunk(admission, server, "b1", "batch")
        held.append(await first_chunk(admission, server, "i1"))  # interactive still gets in: 3 waiting now
        with pytest.raises(APIError) as full:
            await first_chunk(admission, server, "i2")
        metrics = await OpenAIService(backend, None, await backend.model_info(), "ing").metrics_text()
        server.release.set()
        outputs = [[c.text async for c in stream] for stream in held]
        after = await first_chunk(admission, server, "i3")  # the queue drained: admitted again
        await after.aclose()
        return batch_refused.value, full.value, metrics, outputs

    batch_refused, full, metrics, outputs = asyncio.run(main())
    assert batch_refused.status == 429 and batch_refused.retry_after_s >= 1.0 and "batch" in str(batch_refused)
    assert full.status == 429 and "max_waiting_requests" in str(full)
    assert outputs == [["a", "b"]] * 3
    assert server.sent == ["i0", "b0", "i1", "i3"]  # refused requests never reached a replica
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(metrics) for s in family.samples}
    ingress = (("ingress", "ing"), ("model_name", "m"))
    assert series[("iterserve_ingress_requests_shed_total", (*ingress, ("priority", "batch")))] == 1
    assert series[("iterserve_ingress_requests_waiting", (*ingress, ("priority", "interactive")))] == 2
    assert not any(name.startswith("iterserve_ingress_failed_attempts") for name, _ in series)  # no failover here
    stats = admission.stats()
    assert num_waiting(admission) == 0 and stats.num_shed[Priority.INTERACTIVE] == 1
    assert backend.admission_stats() == stats and backend.failover_counters() is None


def test_a_request_closed_before_its_first_token_leaves_the_queue():
    clock = FakeClock(0.0)
    server, admission, _ = held_backend(AdmissionPolicy(max_waiting_requests=1), clock)

    async def main():
        stream = await first_chunk(admission, server, "gone")
        waiting = num_waiting(admission)
        await stream.aclose()  # the client hung up
        again = await first_chunk(admission, server, "next")
        await again.aclose()
        return waiting

    assert asyncio.run(main()) == 1
    assert num_waiting(admission) == 0


def test_unary_requests_are_watched_through_their_stream():
    clock = FakeClock(0.0)
    server, admission, backend = held_backend(AdmissionPolicy(), clock)
    server.release.set()
    whole = asyncio.run(backend.generate(request("u")))
    assert (whole.text, whole.token_ids, whole.finished) == ("ab", [1, 2], True)
    assert num_waiting(admission) == 0 and server.sent == ["u"]


def test_without_the_stage_a_local_backend_admits_everything():
    server = HeldServer()
    server.release.set()
    backend = LocalBackend(server)
    whole = asyncio.run(backend.generate(request("u")))
    assert whole.text == "ab" and backend.admission_stats() is None and backend.failover_counters() is None
