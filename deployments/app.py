"""The Ray Serve application: `OpenAIIngress` (HTTP and handle API) -> `LLMServer` replicas.

    serve run deployments.app:build_app                          # embedded default model
    serve deploy deployments/serve_config.yaml                   # a config, on a cluster

The ingress calls LLMServer through a DeploymentHandle with one GenerateRequest (token ids, block
hashes, priority), so a request router on LLMServer sees real request objects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from autoscaler.admission import AdmissionPolicy
from autoscaler.serve_policy import autoscaling_config
from deployments.admitted_backend import AdmittedBackend
from deployments.errors import APIError, internal, not_ready, overloaded
from deployments.frontend import OpenAIFrontend
from deployments.app_config import AppArgs
from deployments.llm_server import LLMServer
from deployments.protocol import GenerateRequest, GenerationChunk, ModelInfo

LLM_SERVER = "LLMServer"
INGRESS = "OpenAIIngress"
# Replies from every replica (health, metrics) are awaited at most this long.
BROADCAST_TIMEOUT_S = 5.0


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The application for `serve run` / `serve deploy` (import path deployments.app:build_app)."""
    app_args = AppArgs.parse(args)
    if app_args.autoscaling is not None:
        scaling: dict[str, Any] = {"autoscaling_config": autoscaling_config(**app_args.autoscaling)}
        most_replicas = scaling["autoscaling_config"]["max_replicas"]
    else:
        scaling = {"num_replicas": app_args.num_replicas or 1}
        most_replicas = scaling["num_replicas"]
    server = serve.deployment(LLMServerDeployment).options(
        name=LLM_SERVER,
        **scaling,
        # Draining: a replica being removed takes no new requests and gets drain_timeout_s to
        # finish the ones it runs (streams included), checked every second.
        graceful_shutdown_timeout_s=app_args.drain_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
        ray_actor_options=app_args.llm_server_actor_options,
        max_ongoing_requests=app_args.max_ongoing_requests,
        max_queued_requests=app_args.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="router.serve_router:PrefixAwareRouter",
            request_router_kwargs=app_args.router,
            request_routing_stats_period_s=app_args.routing_stats_period_s,
            # A report holds every cached block hash; give a busy replica time to send it.
            request_routing_stats_timeout_s=max(5.0, 5 * app_args.routing_stats_period_s),
        ),
    ).bind(app_args.model, app_args.engine_args, app_args.served_model_name, app_args.admission)
    ingress = OpenAIIngress.options(
        num_replicas=app_args.ingress_replicas,
        ray_actor_options=app_args.ingress_actor_options,
        max_ongoing_requests=max(1024, app_args.max_ongoing_requests * most_replicas),
    )
    return ingress.bind(server, app_args.model, app_args.engine_args.get("tokenizer"), app_args.api_key,
                        app_args.ingress_admission)


class LLMServerDeployment(LLMServer):
    """LLMServer as a Serve replica: the replica id names it in metrics and routing stats."""

    def __init__(self, model: str | None, engine_args: dict[str, Any], served_model_name: str | None,
                 admission: dict[str, Any]) -> None:
        replica_id = serve.get_replica_context().replica_id.unique_id
        super().__init__(model, engine_args, served_model_name=served_model_name, admission=admission,
                         replica_id=replica_id)


class HandleBackend:
    """The OpenAI service's Backend over a DeploymentHandle to LLMServer; Ray and Serve failures
    become APIErrors (503 when no replica can take the call, 429 under back pressure)."""

    def __init__(self, handle: DeploymentHandle, app_name: str) -> None:
        self.handle = handle
        self.app_name = app_name

    async def model_info(self) -> ModelInfo:
        return await _call(self.handle.model_info.remote())

    async def generate(self, request: GenerateRequest) -> GenerationChunk:
        return await _call(self.handle.generate.remote(request))

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        responses = self.handle.options(stream=True).generate_stream.remote(request)
        finished = False
        try:
            async for chunk in responses:
                finished = chunk.finished
                yield chunk
        except BaseException as exc:
            raise _api_error(exc) from None
        finally:
            if not finished:  # the caller left early: the replica aborts the request
                responses.cancel()

    async def health(self) -> tuple[bool, dict[str, Any]]:
        states = await self.replica_states()
        replies = await self._broadcast("ready")
        ready = sum(1 for r in replies if isinstance(r, dict) and r.get("model_loaded") and r.get("engine_running"))
        running = states.get("RUNNING", 0)
        # Every replica Serve counts must be running and must have said it is ready.
        healthy = running > 0 and sum(states.values()) == running and ready >= running
        return healthy, {"replicas": states, "ready_replicas": ready}

    async def metrics_snapshots(self) -> list[dict[str, Any]]:
        return [r for r in await self._broadcast("metrics_snapshot") if isinstance(r, dict)]

    async def _broadcast(self, method: str) -> list[Any]:
        """Every running replica's reply (an exception in place of a failed one); [] when there is
        no replica yet."""
        try:
            return await self.handle.broadcast(method).results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                                     return_exceptions=True)
        except (DeploymentUnavailableError, TimeoutError):
            return []

    async def replica_states(self) -> dict[str, int]:
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        deployment = app.deployments.get(LLM_SERVER) if app is not None else None
        if deployment is None:
            return {}
        return {str(getattr(state, "value", state)): n for state, n in deployment.replica_states.items() if n}


@serve.deployment(name=INGRESS)
@serve.ingress()
class OpenAIIngress(OpenAIFrontend):
    def __init__(self, llm_server: DeploymentHandle, model: str | None, tokenizer: str | None,
                 api_key: str | None, admission: dict[str, Any] | None = None) -> None:
        context = serve.get_replica_context()
        source = tokenizer or model
        backend = AdmittedBackend(HandleBackend(llm_server, context.app_name), AdmissionPolicy(**(admission or {})),
                                  time.monotonic)
        super().__init__(backend, lambda: _load_tokenizer(source), api_key=api_key,
                         ingress_id=context.replica_id.unique_id)
        self.load_tokenizer_now()

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi_app()


async def _call(response: Any) -> Any:
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
    except BaseException as exc:
        raise _api_error(exc) from None


def _api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, (APIError, asyncio.CancelledError, GeneratorExit, KeyboardInterrupt)):
        return exc
    if isinstance(exc, BackPressureError):
        return overloaded("every model replica's queue is full; retry shortly", 1.0)
    if isinstance(exc, (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError)):
        return not_ready(f"the model replica is unavailable ({type(exc).__name__}); retry shortly")
    if isinstance(exc, RayTaskError):
        return internal(f"the model replica failed: {exc.cause!r}" if exc.cause else str(exc))
    return internal(f"{type(exc).__name__}: {exc}")


def _load_tokenizer(source: str | None) -> Any:
    from transformers import AutoTokenizer

    if source is None:
        from model_worker.default_model import default_model_path
        source = default_model_path()
    from model_worker.runner.loader import resolve_model_path
    return AutoTokenizer.from_pretrained(resolve_model_path(source))
