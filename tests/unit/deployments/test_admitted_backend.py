"""Ingress admission in front of a backend: batch requests get 429 first once requests wait, the
queue is released however a request ends, and /metrics shows it. A fake backend whose streams
hold their first token until the test releases them; a fake clock."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.admission import AdmissionPolicy
from contracts.sampling import SamplingParams
from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments.admitted_backend import AdmittedBackend
from deployments.errors import APIError
from deployments.openai_service import OpenAIService
from tests.unit.fakes import FakeClock


class HeldBackend:
    """Every stream yields its admission chunk, then waits for `release` before two tokens."""

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

    async def metrics_snapshots(self):
        return []

    async def replica_states(self):
        return {"RUNNING": 1}


def request(rid: str, priority: str = "interactive") -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2), priority=priority, request_id=rid)


async def first_chunk(backend: AdmittedBackend, rid: str, priority: str = "interactive"):
    stream = backend.generate_stream(request(rid, priority))
    await stream.__anext__()
    return stream


def test_batch_is_shed_first_and_interactive_only_at_the_hard_limit():
    clock = FakeClock(0.0)
    inner = HeldBackend()
    backend = AdmittedBackend(inner, AdmissionPolicy(max_waiting_requests=3, batch_max_wait_s=0.5), clock)

    async def main():
        held = [await first_chunk(backend, "i0"), await first_chunk(backend, "b0", "batch")]
        clock.advance(1.0)  # the oldest request has waited 1 s for a first token
        with pytest.raises(APIError) as batch_refused:
            await first_chunk(backend, "b1", "batch")
        held.append(await first_chunk(backend, "i1"))  # interactive still gets in: 3 waiting now
        with pytest.raises(APIError) as full:
            await first_chunk(backend, "i2")
        metrics = await OpenAIService(backend, None, await backend.model_info(), "ing").metrics_text()
        inner.release.set()
        outputs = [[c.text async for c in stream] for stream in held]
        after = await first_chunk(backend, "i3")  # the queue drained: admitted again
        await after.aclose()
        return batch_refused.value, full.value, metrics, outputs

    batch_refused, full, metrics, outputs = asyncio.run(main())
    assert batch_refused.status == 429 and batch_refused.retry_after_s >= 1.0 and "batch" in str(batch_refused)
    assert full.status == 429 and "max_waiting_requests" in str(full)
    assert outputs == [["a", "b"]] * 3
    assert inner.sent == ["i0", "b0", "i1", "i3"]  # refused requests never reached a replica
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(metrics) for s in family.samples}
    ingress = (("ingress", "ing"), ("model_name", "m"))
    assert series[("iterserve_ingress_requests_shed_total", (*ingress, ("priority", "batch")))] == 1
    assert series[("iterserve_ingress_requests_waiting", (*ingress, ("priority", "interactive")))] == 2
    snapshot = backend.admission.snapshot()
    assert snapshot["num_waiting_first_token"] == 0 and snapshot["num_shed_interactive"] == 1


def test_a_request_closed_before_its_first_token_leaves_the_queue():
    clock = FakeClock(0.0)
    backend = AdmittedBackend(HeldBackend(), AdmissionPolicy(max_waiting_requests=1), clock)

    async def main():
        stream = await first_chunk(backend, "gone")
        waiting = backend.admission.snapshot()["num_waiting_first_token"]
        await stream.aclose()  # the client hung up
        again = await first_chunk(backend, "next")
        await again.aclose()
        return waiting

    assert asyncio.run(main()) == 1
    assert backend.admission.snapshot()["num_waiting_first_token"] == 0


def test_unary_requests_are_watched_through_their_stream():
    clock = FakeClock(0.0)
    inner = HeldBackend()
    inner.release.set()
    backend = AdmittedBackend(inner, AdmissionPolicy(), clock)
    whole = asyncio.run(backend.generate(request("u")))
    assert (whole.text, whole.token_ids, whole.finished) == ("ab", [1, 2], True)
    assert backend.admission.snapshot()["num_waiting_first_token"] == 0
