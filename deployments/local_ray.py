"""A local Ray that listens on loopback only: `iterserve serve`, and the tests and benchmarks.

`ray.init()` binds the GCS, raylet, workers, dashboard agent, runtime-env agent and metrics
exporters to every interface (or the machine's external address), even with
`_node_ip_address="127.0.0.1"`: Ray swaps a loopback address for the external one unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray/_private/services.py, resolve_ip_for_localhost and
get_node_ip_address). That variable must be set before Ray starts, in this process and in every
process that later connects to this Ray. Each Serve replica also opens an inter-deployment gRPC
server on `[::]:0`, hard-coded (ray/serve/_private/replica.py); a worker setup hook binds it to
loopback instead. With both, every Ray listener is on 127.0.0.1 (tests/integration check it with
/proc/net/tcp). A multi-node cluster needs the opposite, and docs/cluster.md says what protects
it instead.

Ray's token authentication stays as Ray sets it (on for a local `ray.init()`): only tests turn it
off, with RAY_AUTH_MODE=disabled.
"""

from __future__ import annotations

import os
from typing import Any

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SETUP_HOOK = "deployments.local_ray.bind_replica_grpc_to_loopback"


def init_local_ray(**init_kwargs: Any) -> None:
    """ray.init() of a new local Ray whose every listener is on 127.0.0.1, and whose Serve proxy
    bounds idle and slow connections (deployments/http_guard.py)."""
    from deployments import http_guard

    os.environ.update(LOOPBACK_ENV)
    os.environ.setdefault(http_guard.CALLBACK_ENV, http_guard.IMPORT_PATH)
    import ray
    from ray._private import ray_constants

    # Read from the environment when ray is imported: right it here if that already happened.
    ray_constants.ENABLE_RAY_CLUSTER = False
    runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
    runtime_env.setdefault("worker_process_setup_hook", SETUP_HOOK)
    ray.init(runtime_env=runtime_env, **init_kwargs)


def bind_replica_grpc_to_loopback() -> None:
    """Ray worker setup hook: Serve replicas bind their gRPC server to 127.0.0.1, not [::]."""
    try:
        import ray.serve._private.replica as replica
    except ImportError:  # a Ray without Serve's replica module: nothing to bind
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_iterserve_loopback", False):
        return

    def add_port_on_loopback(server: Any, address: str) -> int:
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return original(server, address)

    add_port_on_loopback._iterserve_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_on_loopback
