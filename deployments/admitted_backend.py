"""AdmittedBackend: ingress admission control (autoscaler/admission.py) in front of any Backend.

Every generation request asks the AdmissionController first; a refused one becomes a 429 with
Retry-After before anything is sent to a replica. An admitted request is watched until its first
token, which is what the controller's queue and predicted wait are made of. Unary requests are
sent as streams for that reason: a unary reply would only show when the whole answer was done, and
a long answer would look like a long wait in the queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from autoscaler.admission import AdmissionController, AdmissionPolicy, Ticket
from deployments.errors import overloaded
from deployments.openai_service import Backend
from deployments.protocol import GenerateRequest, GenerationChunk, ModelInfo


class AdmittedBackend:
    def __init__(self, backend: Backend, policy: AdmissionPolicy, clock: Callable[[], float]) -> None:
        self.backend = backend
        self.admission = AdmissionController(policy, clock)

    async def model_info(self) -> ModelInfo:
        return await self.backend.model_info()

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        whole = GenerationChunk(request.request_id)
        async for chunk in self.generate_stream(request):
            whole.extend(chunk)
        return whole

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        ticket = self._admit(request)
        with ticket:
            async for chunk in self.backend.generate_stream(request):
                if chunk.token_ids:
                    ticket.first_token()
                yield chunk

    def _admit(self, request: GenerateRequest) -> Ticket:
        verdict, ticket = self.admission.admit(request.priority)
        if ticket is None:
            raise overloaded(f"the service is overloaded: {verdict.reason}; retry later", verdict.retry_after_s or 1.0)
        return ticket

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return await self.backend.health()

    async def metrics_snapshots(self) -> list[dict[str, Any]]:
        return await self.backend.metrics_snapshots()

    async def replica_states(self) -> dict[str, int]:
        return await self.backend.replica_states()
