"""AppArgs: the `args:` of the Serve application (deployments/serve_config.yaml). Pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autoscaler.admission import AdmissionPolicy, replica_policy
from autoscaler.policy import AutoscalerConfig
from contracts.checks import is_int, is_number
from deployments.retry_policy import RetryPolicy
from router.policy import RouterConfig


@dataclass(slots=True)
class AppArgs:
    """What `build_app` takes (the `args:` of a Serve config). Validated here, once."""

    # A checkpoint directory, hub id, .gguf file, "tiny", or None: the embedded default model.
    model: str | None = None
    # The name clients send as `model`; defaults to one derived from `model` ("SmolLM2-135M-Instruct"
    # for the embedded default, model_worker.checkpoints.models.served_name).
    served_model_name: str | None = None
    # EngineConfig fields (max_num_seqs, device, dtype, ...), passed to every LLMServer replica.
    engine_args: dict[str, Any] = field(default_factory=dict)
    # A fixed number of LLMServer replicas (None: 1), or `autoscaling` instead.
    num_replicas: int | None = None
    # Scale LLMServer on queue length and TTFT (autoscaler/): min_replicas, max_replicas,
    # initial_replicas and the AutoscalerConfig fields (target_queue_per_replica, ttft_slo_s,
    # warm_spares, scale_up_delay_s, scale_down_delay_s, ...). None: a fixed count.
    autoscaling: dict[str, Any] | None = None
    ingress_replicas: int = 1
    # Without `Authorization: Bearer <api_key>` every endpoint but /health answers 401.
    api_key: str | None = None
    # replica_policy arguments (autoscaler/admission.py: max_waiting_requests, batch_shed_fraction,
    # retry_after_s): when a replica refuses work with 429 (the backstop behind the ingress's own
    # admission control).
    admission: dict[str, Any] = field(default_factory=dict)
    # AdmissionPolicy fields (autoscaler/admission.py): the ingress's bounded queue, and the
    # predicted wait past which batch requests get 429 first.
    ingress_admission: dict[str, Any] = field(default_factory=dict)
    # A replica being removed (scale-down, redeploy) takes no new requests and gets this long to
    # finish its running ones before it stops; requests still running then are aborted.
    drain_timeout_s: float = 60.0
    # Ray resources per replica. num_cpus 0 lets small machines run several replicas; a GPU
    # deployment sets {"num_gpus": 1}.
    llm_server_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    ingress_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    # Concurrent requests one LLMServer replica accepts from Serve. Continuous batching wants many:
    # the engine's own admission (KV blocks, max_num_seqs, the waiting limit) does the gating.
    max_ongoing_requests: int = 1024
    # Requests queued in the callers' routers beyond that; -1 is unbounded. Over it: 429.
    max_queued_requests: int = -1
    # The request router on LLMServer (router/serve_router.py): `policy` (prefix_aware, pow2,
    # round_robin, random), the scoring weights of router.policy.RouterConfig, dispatch_ttl_s, seed.
    router: dict[str, Any] = field(default_factory=lambda: {"policy": "prefix_aware"})
    # How often each replica reports its load and prefix cache to the routers (Serve polls it).
    routing_stats_period_s: float = 1.0
    # Serve's health check of every replica: how often, and how long one may take. Three failures
    # in a row replace the replica: an engine that stopped is noticed within ~3 s, a frozen replica
    # within ~3 timeouts.
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 3.0
    # RetryPolicy fields (deployments/handle_backend.py): max_attempts, first_reply_timeout_s,
    # stall_timeout_s, backoff_s. How the ingress fails a request over to another replica when
    # its replica dies, freezes or refuses, resuming a stream where the client's stands.
    retry: dict[str, Any] = field(default_factory=dict)
    # A request body must arrive whole within this long, or the request gets 408.
    request_body_timeout_s: float = 30.0
    # Chunks per second each LLMServer replica streams over all its requests; beyond it a request's
    # tokens go out together (deployments/llm_server.py STREAM_CHUNKS_PER_S says why and how).
    stream_chunks_per_s: float = 50.0
    # ... but no stream waits longer than this between chunks (MAX_STREAM_INTERVAL_S there).
    max_stream_interval_s: float = 0.5
    # Replicas on the ingress's node send each request's chunks after admission over a loopback
    # connection to the ingress instead of Ray's stream (deployments/token_channel.py): far less
    # CPU a chunk. False: every chunk over Ray.
    token_channel: bool = True

    def __post_init__(self) -> None:
        if self.autoscaling is not None and self.num_replicas is not None:
            raise ValueError("give num_replicas or autoscaling, not both")
        for name in ("ingress_replicas", "max_ongoing_requests") + (("num_replicas",) if self.num_replicas is not None
                                                                    else ()):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_queued_requests, int) or not (self.max_queued_requests == -1
                                                                 or self.max_queued_requests >= 1):
            raise ValueError(f"max_queued_requests must be -1 or >= 1, got {self.max_queued_requests!r}")
        for name in ("routing_stats_period_s", "drain_timeout_s", "health_check_period_s", "health_check_timeout_s",
                     "request_body_timeout_s", "stream_chunks_per_s", "max_stream_interval_s"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not isinstance(self.token_channel, bool):
            raise ValueError(f"token_channel must be true or false, got {self.token_channel!r}")
        for name in ("engine_args", "admission", "ingress_admission", "llm_server_actor_options",
                     "ingress_actor_options", "router", "retry"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a mapping, got {getattr(self, name)!r}")
        if self.autoscaling is not None:
            if not isinstance(self.autoscaling, dict):
                raise ValueError(f"autoscaling must be a mapping, got {self.autoscaling!r}")
            AutoscalerConfig(**{k: v for k, v in self.autoscaling.items() if k != "initial_replicas"})
        replica_policy(**self.admission)
        AdmissionPolicy(**self.ingress_admission)
        RetryPolicy(**self.retry)
        router = {k: v for k, v in self.router.items() if k not in ("dispatch_ttl_s", "seed")}
        RouterConfig(**router)

    @classmethod
    def parse(cls, args: dict[str, Any] | None) -> "AppArgs":
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown application args {unknown}; known: {sorted(known)}")
        return cls(**args)
