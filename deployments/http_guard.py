"""Connection limits for Ray Serve's HTTP proxy, which has none of its own for idle connections.

Serve's proxy runs uvicorn with a keep-alive timeout only: that timer starts after a response and
is cancelled by any byte received, and nothing bounds a connection that never completes a
request. 1,300 idle or slowly-sending connections were held indefinitely (the proxy's file limit
is 20,000). Serve runs `install()` in the proxy process at start when
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names it (deployments/local_ray.py sets it for a local
Ray; docs/cluster.md shows it for `ray start`). With Serve's direct ingress the ingress replica
runs the HTTP server itself, and OpenAIIngress installs the guard there (`install_in_ingress`).
It adds, on uvicorn's HTTP protocols:

- a request header deadline: a connection must complete a request's headers within
  `header_timeout_s` of opening, or of its previous response, or it gets 408 and is closed;
- a connection cap: past `max_connections` open connections, a new one is closed at once (a load
  balancer sees a reset and tries another proxy).

Request bodies have their own deadline in the ingress (deployments/frontend.py), which reads them.
Settings come from the environment of the proxy process, read when install() runs:
ITERSERVE_HTTP_HEADER_TIMEOUT_S (default 10) and ITERSERVE_HTTP_MAX_CONNECTIONS (default 4096).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

IMPORT_PATH = "deployments.http_guard:install"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"content-length: 35\r\nconnection: close\r\n\r\nthe request headers took too long.\n")


@dataclass(slots=True, frozen=True)
class GuardConfig:
    # A client has this long to send a request's headers (from connecting, or from the end of the
    # previous response). 10 s is generous for any real client (headers are a few hundred bytes)
    # and bounds what a connection that sends nothing, or a byte at a time, can hold.
    header_timeout_s: float = 10.0
    # Open connections past which new ones are closed at once: well under the proxy's file limit,
    # far above what one proxy serves (each live stream is one connection).
    max_connections: int = 4096

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s!r}")
        if not self.max_connections >= 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")

    @classmethod
    def from_environment(cls) -> "GuardConfig":
        default = cls()
        return cls(header_timeout_s=float(os.environ.get("ITERSERVE_HTTP_HEADER_TIMEOUT_S", default.header_timeout_s)),
                   max_connections=int(os.environ.get("ITERSERVE_HTTP_MAX_CONNECTIONS", default.max_connections)))


def install() -> list[Any]:
    """Serve's proxy callback: patch uvicorn's protocols; no middleware. It never raises: Serve
    would not start the proxy at all (the failure is logged, and the tests check the limits)."""
    try:
        config = GuardConfig.from_environment()
        for protocol in _protocol_classes():
            guard_protocol(protocol, config)
    except Exception:
        logger.exception("iterserve http guard: not installed; idle connections are not bounded")
        return []
    logger.info("iterserve http guard: header timeout %.0f s, at most %d connections",
                config.header_timeout_s, config.max_connections)
    return []


def install_in_ingress() -> bool:
    """Install the guard in this ingress replica's process when Serve's direct ingress has it
    serve HTTP itself with nothing in front of it; True if it did. Behind HAProxy (Serve's HAProxy
    mode) clients reach HAProxy only, and HAProxy enforces these limits
    (deployments/local_ray.py, haproxy_template)."""
    from ray.serve._private import constants

    if not constants.RAY_SERVE_ENABLE_DIRECT_INGRESS or constants.RAY_SERVE_ENABLE_HA_PROXY:
        return False
    install()
    return True


def _protocol_classes() -> list[type]:
    classes = []
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        classes.append(HttpToolsProtocol)
    except ImportError:  # uvicorn without httptools: h11 only
        pass
    from uvicorn.protocols.http.h11_impl import H11Protocol
    classes.append(H11Protocol)
    return classes


def guard_protocol(protocol: type, config: GuardConfig) -> None:
    """Wrap one uvicorn protocol class's connection_made and on_response_complete (idempotent)."""
    if getattr(protocol, "_iterserve_guard", None) is not None:
        protocol._iterserve_guard = config
        return
    connection_made = protocol.connection_made
    on_response_complete = protocol.on_response_complete

    def guarded_connection_made(self: Any, transport: Any) -> None:
        connection_made(self, transport)
        guard = type(self)._iterserve_guard
        if len(self.connections) > guard.max_connections:
            transport.close()
            return
        _arm(self, guard)

    def guarded_on_response_complete(self: Any) -> None:
        on_response_complete(self)
        if not self.transport.is_closing():
            _arm(self, type(self)._iterserve_guard)

    protocol.connection_made = guarded_connection_made
    protocol.on_response_complete = guarded_on_response_complete
    protocol._iterserve_guard = config


def _arm(connection: Any, guard: GuardConfig) -> None:
    """Close the connection unless a new request's headers arrive within the deadline: uvicorn
    starts a new request cycle once headers are complete, so an unchanged cycle means none came."""
    timer = getattr(connection, "_iterserve_header_timer", None)
    if timer is not None:
        timer.cancel()
    armed_cycle = connection.cycle
    connection._iterserve_header_timer = connection.loop.call_later(
        guard.header_timeout_s, _expire, connection, armed_cycle)


def _expire(connection: Any, armed_cycle: Any) -> None:
    connection._iterserve_header_timer = None
    cycle = connection.cycle
    if connection.transport.is_closing():
        return
    if cycle is not armed_cycle and cycle is not None:
        return  # a request arrived: it is the keep-alive timer's (and the app's) business now
    connection.transport.write(_TIMEOUT_RESPONSE)
    connection.transport.close()
