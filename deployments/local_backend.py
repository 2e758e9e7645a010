"""LocalBackend: the OpenAI service over an LLMServer in the same process (tests, embedding)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments.llm_server import LLMServer


class LocalBackend:
    def __init__(self, server: LLMServer) -> None:
        self.server = server

    async def model_info(self) -> ModelInfo:
        return await self.server.model_info()

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        return await self.server.generate(request)

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        return self.server.generate_stream(request)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        ready = await self.server.ready()
        healthy = ready["model_loaded"] and ready["engine_running"]
        return healthy, {"replicas": {"RUNNING": 1}, "ready_replicas": int(healthy)}

    async def metrics_snapshots(self) -> list[dict[str, Any]]:
        return [await self.server.metrics_snapshot()]

    async def replica_states(self) -> dict[str, int]:
        return {"RUNNING": 1}
