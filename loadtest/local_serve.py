"""A local Ray with one Serve HTTP proxy on a free loopback port, for benchmarks and tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_serve(num_cpus: int | None = None) -> str:
    """Start Ray (every listener on loopback, no dashboard, workers' logs kept off the driver) and
    Serve's proxy on 127.0.0.1; return the proxy's base URL. `stop_local_serve` undoes it."""
    from ray import serve

    from deployments.local_ray import init_local_ray

    init_local_ray(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
