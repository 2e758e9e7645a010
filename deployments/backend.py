"""Backend: everything the OpenAI frontend and service call on the LLMServer replicas behind them.

Two implementations: HandleBackend (deployments/handle_backend.py), over a Serve DeploymentHandle,
with failover across replicas and the ingress's admission control as a stage of its generation
path; LocalBackend (deployments/local_backend.py), over an LLMServer in the same process (tests,
embedding), the admission stage optional. This module imports neither.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from contracts.serving import GenerateRequest, GenerationChunk, ModelInfo
from deployments.metrics import AdmissionStats, FailoverCounters, ReplicaMetrics, TokenChannelCounters


class Backend(Protocol):
    async def model_info(self) -> ModelInfo:
        """What a replica serves: the model's limits the ingress checks requests against."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        """The whole answer, as one finished chunk."""
        ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """The request's chunks; the first (no tokens) confirms that it was admitted, and every
        refusal is raised before it, as an APIError. Closing the stream early cancels the request."""
        ...

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, detail) for /health: replicas by state, how many are ready."""
        ...

    async def metrics_snapshots(self) -> list[ReplicaMetrics]:
        """Every replica's metric families that answered in time."""
        ...

    async def replica_states(self) -> dict[str, int]:
        """LLMServer replicas by state."""
        ...

    def admission_stats(self) -> AdmissionStats | None:
        """The ingress's admission control; None when this backend admits everything."""
        ...

    def failover_counters(self) -> FailoverCounters | None:
        """Attempts failed over and requests migrated; None when this backend has one replica."""
        ...

    def token_channel_counters(self) -> TokenChannelCounters | None:
        """What came over the token channel; None when this backend has none."""
        ...
