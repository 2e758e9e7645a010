"""The serving paths' Serve settings, and the port range the direct one needs (no Ray started)."""

from __future__ import annotations

import os
import socket

import pytest

from deployments.local_ray import DIRECT_INGRESS_PORTS, serving_path_env
from loadtest.local_serve import free_port_range


def test_direct_ingress_listens_on_the_given_port_first():
    env = serving_path_env("direct", 8000)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    # Serve hands out ports lowest first from [min, max): the first ingress replica gets 8000.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == \
        ("8000", str(8000 + DIRECT_INGRESS_PORTS))
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"


def test_the_proxy_path_turns_off_what_the_direct_one_turns_on():
    # One process can start Ray twice (tests do): the second start must not inherit the first's.
    direct, proxy = serving_path_env("direct", 8000), serving_path_env("proxy")
    assert set(proxy) <= set(direct)
    assert proxy == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


@pytest.mark.parametrize("path, port", [("direct", None), ("direct", 0), ("direct", 65535), ("haproxy", 8000)])
def test_a_bad_serving_path_or_port_is_refused(path, port):
    with pytest.raises(ValueError):
        serving_path_env(path, port)


def test_a_free_port_range_is_free_throughout():
    first = free_port_range(DIRECT_INGRESS_PORTS)
    for port in range(first, first + DIRECT_INGRESS_PORTS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("preset, expected", [(None, "0.5"), ("0.1", "0.1")])
def test_serves_control_loop_is_slowed_for_a_shared_machine_unless_the_environment_says(monkeypatch, preset, expected):
    import ray

    from deployments import http_guard, local_ray

    started = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.append(kwargs))
    # Whatever init_local_ray sets is put back after the test.
    for name in [*local_ray.SHARED_MACHINE_ENV, *local_ray.LOOPBACK_ENV, *serving_path_env("proxy"),
                 http_guard.CALLBACK_ENV]:
        monkeypatch.delenv(name, raising=False)
    if preset is not None:
        monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", preset)
    local_ray.init_local_ray("proxy")
    assert started and os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == expected
