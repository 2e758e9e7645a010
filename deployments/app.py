"""The Ray Serve application: `OpenAIIngress` (HTTP and handle API) -> `LLMServer` replicas.

    serve run deployments.app:build_app                          # embedded default model
    serve deploy deployments/serve_config.yaml                   # a config, on a cluster

The ingress calls LLMServer through a DeploymentHandle with one GenerateRequest (token ids, block
hashes, priority), so a request router on LLMServer sees real request objects.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from autoscaler.admission import AdmissionPolicy
from autoscaler.serve_policy import autoscaling_config
from deployments import http_guard
from deployments.app_config import AppArgs
from deployments.frontend import OpenAIFrontend
from deployments.handle_backend import HandleBackend
from deployments.ingress_admission import IngressAdmission
from deployments.llm_server import MAX_STREAM_INTERVAL_S, STREAM_CHUNKS_PER_S, LLMServer
from deployments.retry_policy import RetryPolicy
from deployments.token_channel import TokenChannelServer

LLM_SERVER = "LLMServer"
INGRESS = "OpenAIIngress"


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
        # A replica whose engine stopped fails check_health at once; Serve replaces it after 3
        # failures in a row. Serve's defaults (every 10 s, 30 s timeout) kept a dead replica in
        # the routing set for ~20-30 s; these notice within ~3 s (a frozen one within 3 timeouts).
        health_check_period_s=app_args.health_check_period_s,
        health_check_timeout_s=app_args.health_check_timeout_s,
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
    ).bind(app_args.model, app_args.engine_args, app_args.served_model_name, app_args.admission,
           app_args.stream_chunks_per_s, app_args.max_stream_interval_s)
    ingress = OpenAIIngress.options(
        num_replicas=app_args.ingress_replicas,
        ray_actor_options=app_args.ingress_actor_options,
        max_ongoing_requests=max(1024, app_args.max_ongoing_requests * most_replicas),
        health_check_period_s=app_args.health_check_period_s,
        health_check_timeout_s=app_args.health_check_timeout_s,
    )
    return ingress.bind(server, app_args.model, app_args.engine_args.get("tokenizer"), app_args.api_key,
                        app_args.ingress_admission, app_args.retry, app_args.request_body_timeout_s,
                        app_args.token_channel)


class LLMServerDeployment(LLMServer):
    """LLMServer as a Serve replica: the replica id names it in metrics and routing stats."""

    def __init__(self, model: str | None, engine_args: dict[str, Any], served_model_name: str | None,
                 admission: dict[str, Any], stream_chunks_per_s: float = STREAM_CHUNKS_PER_S,
                 max_stream_interval_s: float = MAX_STREAM_INTERVAL_S) -> None:
        replica_id = serve.get_replica_context().replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        super().__init__(model, engine_args, served_model_name=served_model_name, admission=admission,
                         replica_id=replica_id, stream_chunks_per_s=stream_chunks_per_s,
                         max_stream_interval_s=max_stream_interval_s, node_id=lambda: node_id)


@serve.deployment(name=INGRESS)
@serve.ingress()
class OpenAIIngress(OpenAIFrontend):
    def __init__(self, llm_server: DeploymentHandle, model: str | None, tokenizer: str | None,
                 api_key: str | None, admission: dict[str, Any] | None = None,
                 retry: dict[str, Any] | None = None, body_timeout_s: float = 30.0,
                 token_channel: bool = True) -> None:
        http_guard.install_in_ingress()
        context = serve.get_replica_context()
        source = tokenizer or model
        channel = TokenChannelServer(ray.get_runtime_context().get_node_id()) if token_channel else None
        backend = HandleBackend(llm_server, context.app_name, LLM_SERVER, RetryPolicy(**(retry or {})),
                                admission=IngressAdmission(AdmissionPolicy(**(admission or {})), time.monotonic),
                                token_channel=channel)
        super().__init__(backend, lambda: _load_tokenizer(source), api_key=api_key,
                         ingress_id=context.replica_id.unique_id, body_timeout_s=body_timeout_s)
        self.load_tokenizer_now()

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi_app()


def _load_tokenizer(source: str | None) -> Any:
    from model_worker.checkpoints.models import load_tokenizer

    return load_tokenizer(source)
