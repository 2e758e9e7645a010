"""LocalBackend: the OpenAI service over an LLMServer in the same process (tests, embedding).

One replica, so no failover; the ingress's admission stage (IngressAdmission) when one is given.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo, whole_response
from deployments.ingress_admission import IngressAdmission
from deployments.llm_server import LLMServer
from deployments.metrics import AdmissionStats, FailoverCounters, ReplicaMetrics, TokenChannelCounters


class LocalBackend:
    def __init__(self, server: LLMServer, admission: IngressAdmission | None = None) -> None:
        self.server = server
        self.admission = admission

    async def model_info(self) -> ModelInfo:
        return await self.server.model_info()

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        """Sent as a stream, so that the admission stage sees its first token."""
        return await whole_response(request.request_id, self.generate_stream(request))

    def generate_stream(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        if self.admission is None:
            return self.server.generate_stream(request)
        return self.admission.watch(request, self.server.generate_stream)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        ready = await self.server.ready()
        healthy = ready["model_loaded"] and ready["engine_running"]
        return healthy, {"replicas": {"RUNNING": 1}, "ready_replicas": int(healthy)}

    async def metrics_snapshots(self) -> list[ReplicaMetrics]:
        return [await self.server.metrics_snapshot()]

    async def replica_states(self) -> dict[str, int]:
        return {"RUNNING": 1}

    def admission_stats(self) -> AdmissionStats | None:
        return self.admission.stats() if self.admission is not None else None

    def failover_counters(self) -> FailoverCounters | None:
        return None

    def token_channel_counters(self) -> TokenChannelCounters | None:
        return None
