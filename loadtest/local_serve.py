"""A local Ray with Serve on free loopback ports, for benchmarks and tests."""

from __future__ import annotations

from deployments.local_ray import DEFAULT_SERVING_PATH, free_port, free_port_range


def start_local_serve(num_cpus: int | None = None, serving_path: str = DEFAULT_SERVING_PATH) -> str:
    """Start Ray (every listener on loopback, no dashboard, workers' logs kept off the driver) and
    Serve on 127.0.0.1; return the base URL of the first application's HTTP entry point: with
    the "proxy" serving path (the default, as `iterserve serve` runs) Serve's HTTP proxy, with
    "haproxy" HAProxy's, with "direct" its ingress replica's own port (`proxy_url()` finds the
    entry point that routes to every application). `stop_local_serve` undoes it."""
    from ray import serve

    from deployments.local_ray import DIRECT_INGRESS_PORTS, init_local_ray

    ingress_port = free_port_range(DIRECT_INGRESS_PORTS) if serving_path != "proxy" else None
    init_local_ray(serving_path, ingress_port, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    proxy_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    # With "haproxy" HAProxy takes the port serve.start is given; with "direct" the ingress has its own.
    return f"http://127.0.0.1:{ingress_port if serving_path == 'direct' else proxy_port}"


def proxy_url() -> str:
    """The base URL of the running local Serve's HTTP entry point that routes by route prefix to
    every application: HAProxy, or Serve's HTTP proxy (with direct ingress each application's
    ingress has a port of its own)."""
    import ray
    from ray.serve.context import _get_global_client

    config = ray.get(_get_global_client()._controller.get_http_config.remote())
    return f"http://{config.host}:{config.port}"


def stop_local_serve() -> None:
    import ray
    from ray import serve

    from deployments.local_ray import restore_environment

    serve.shutdown()
    ray.shutdown()
    restore_environment()
