"""AdmittedBackend: ingress admission control (autoscaler/admission.py) in front of any Backend.

Every generation request asks the AdmissionController first; a refused one becomes a 429 with
Retry-After before anything is sent to a replica. An admitted request is watched until its first
token, which is what the controller's queue and predicted wait are made of. Unary requests are
sent as streams for that reason: a unary reply would only show when the whole answer was done, and
a long answer would look like a long wait in the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from autoscaler.admission import AdmissionController, AdmissionPolicy, Ticket
from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo, whole_response
from deployments.errors import APIError, overloaded
from deployments.openai_service import Backend


class AdmittedBackend:
    def __init__(self, backend: Backend, policy: AdmissionPolicy, clock: Callable[[], float]) -> None:
        self.backend = backend
        self.clock = clock
        self.admission = AdmissionController(policy, clock)

    async def model_info(self) -> ModelInfo:
        return await self.backend.model_info()

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        return await whole_response(request.request_id, self.generate_stream(request))

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """The backend's chunks; a request without a first token after the policy's queue timeout
        is abandoned (its replica aborts it) with a 503 and Retry-After."""
        ticket = self._admit(request)
        timeout_s = self.admission.policy.queue_timeout_for(request.priority)
        deadline_s = ticket.admitted_s + timeout_s
        stream = self.backend.generate_stream(request).__aiter__()
        with ticket:
            try:
                while True:
                    try:
                        if ticket.waiting:
                            chunk = await asyncio.wait_for(stream.__anext__(), max(deadline_s - self.clock(), 0.0))
                        else:
                            chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    except (asyncio.TimeoutError, TimeoutError):
                        self.admission.timed_out(ticket)
                        retry_s = max(self.admission.predicted_wait_s(), self.admission.policy.min_retry_after_s)
                        raise APIError(f"no first token within {timeout_s:g} s: the service is overloaded; "
                                       "retry later", 503, "service_unavailable", None, "queue_timeout",
                                       min(retry_s, self.admission.policy.max_retry_after_s)) from None
                    if chunk.token_ids:
                        ticket.first_token()
                    yield chunk
            finally:
                await stream.aclose()

    def _admit(self, request: GenerateRequest) -> Ticket:
        verdict, ticket = self.admission.admit(request.priority)
        if ticket is None:
            raise overloaded(f"the service is overloaded: {verdict.reason}; retry later", verdict.retry_after_s or 1.0)
        return ticket

    def failover_counters(self) -> dict[str, int]:
        counters = getattr(self.backend, "failover_counters", None)
        return counters() if counters is not None else {}

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return await self.backend.health()

    async def metrics_snapshots(self) -> list[dict[str, Any]]:
        return await self.backend.metrics_snapshots()

    async def replica_states(self) -> dict[str, int]:
        return await self.backend.replica_states()
