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

The serving path (`serving_path_env`) is chosen here too, because Serve reads it from the
environment of each of its processes when they start.
"""

from __future__ import annotations

import os
import socket
from typing import Any

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Serve's settings for a Ray that shares its machine's few cores with the engine, each kept when
# the environment already names it. The controller's loop every 0.5 s, not Serve's 0.1 s: idle, it
# took 3.1% of a core and the GCS 1.6% answering it, against 1.3% and 0.8% at 0.5 s, and on two
# cores every millisecond another process runs costs the engine's OpenMP team about a millisecond
# of its step (docs/benchmarks.md, 'Speed on the CPU against vLLM, third pass'). What waits on the
# loop (a replica's start or replacement, an autoscaling decision) starts up to 0.4 s later.
SHARED_MACHINE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
SETUP_HOOK = "deployments.local_ray.bind_replica_grpc_to_loopback"

SERVING_PATHS = ("direct", "proxy")


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_error(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be listened on now, or None if it can."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None

# Ports from the HTTP port up that direct ingress may give ingress replicas: the first goes to the
# first application's one ingress replica; the rest to other applications' ingresses (each has a
# port of its own) and to a replacement that starts before the replica it replaces has let go.
DIRECT_INGRESS_PORTS = 8


def serving_path_env(path: str, http_port: int | None = None) -> dict[str, str]:
    """Ray Serve's settings for how an HTTP request reaches the ingress, as environment variables.

    - "proxy": Serve's defaults. The HTTP proxy actor listens on the port serve.start is given and
      passes each request, and every chunk of its response stream, to an ingress replica through
      a handle: one more process and one more Ray stream per token.
    - "direct": the ingress replica serves HTTP itself on `http_port` (Serve's direct ingress),
      with the rest of Serve's throughput-optimised settings (user code and the handle's router on
      the replica's own event loop, handle calls over gRPC, request logs buffered and kept off
      stderr). Serve still starts a proxy on the head node, on the port serve.start is given,
      which must be another one; it routes by prefix to every application, which direct ingress
      does not (each application's ingress gets a port of its own, the next ones up from
      `http_port`). Its cost: an ingress replica that dies is replaced on the next free port of
      the range, not on `http_port` (Serve allocates the new replica's port before it releases
      the dead one's), so clients of the old port are refused until they are pointed elsewhere.
      That is why "proxy" is the default of `iterserve serve`.

    docs/benchmarks.md measures what the proxy's hop costs a token on 2 cores."""
    if path == "proxy":
        return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    if path != "direct":
        raise ValueError(f"serving path must be one of {', '.join(SERVING_PATHS)}, got {path!r}")
    if http_port is None or not 0 < http_port <= 65535 - DIRECT_INGRESS_PORTS:
        raise ValueError(f"direct ingress needs an HTTP port in 1..{65535 - DIRECT_INGRESS_PORTS}, got {http_port!r}")
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + DIRECT_INGRESS_PORTS),
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def init_local_ray(serving_path: str = "proxy", http_port: int | None = None, **init_kwargs: Any) -> None:
    """ray.init() of a new local Ray whose every listener is on 127.0.0.1, whose HTTP entry point
    (the proxy, or with direct ingress the ingress replica) bounds idle and slow connections
    (deployments/http_guard.py), and whose Serve takes `serving_path` (`serving_path_env`)."""
    from deployments import http_guard

    os.environ.update(LOOPBACK_ENV)
    for name, value in SHARED_MACHINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.update(serving_path_env(serving_path, http_port))
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
