"""A local Ray with Serve on free loopback ports, for benchmarks and tests."""

from __future__ import annotations

from deployments.local_ray import free_port, port_error


def free_port_range(count: int, attempts: int = 50) -> int:
    """The first of `count` consecutive loopback ports that are all free now."""
    for _ in range(attempts):
        first = free_port()
        rest = range(first + 1, first + count)
        if first + count <= 65536 and all(port_error("127.0.0.1", port) is None for port in rest):
            return first
    raise RuntimeError(f"found no {count} consecutive free ports on 127.0.0.1 in {attempts} tries")


def start_local_serve(num_cpus: int | None = None, serving_path: str = "proxy") -> str:
    """Start Ray (every listener on loopback, no dashboard, workers' logs kept off the driver) and
    Serve on 127.0.0.1; return the base URL of the first application's HTTP entry point: with
    the "proxy" serving path (the default, as `iterserve serve` runs) Serve's HTTP proxy, with
    "direct" its ingress replica's own port (`proxy_url()` finds the proxy either way).
    `stop_local_serve` undoes it."""
    from ray import serve

    from deployments.local_ray import DIRECT_INGRESS_PORTS, init_local_ray

    direct_port = free_port_range(DIRECT_INGRESS_PORTS) if serving_path == "direct" else None
    init_local_ray(serving_path, direct_port, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    proxy_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    return f"http://127.0.0.1:{direct_port or proxy_port}"


def proxy_url() -> str:
    """The base URL of the running local Serve's HTTP proxy, which routes by route prefix to every
    application (with direct ingress each application's ingress has a port of its own)."""
    import ray
    from ray.serve.context import _get_global_client

    config = ray.get(_get_global_client()._controller.get_http_config.remote())
    return f"http://{config.host}:{config.port}"


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
