"""The serving paths' Serve settings and the port range the direct and HAProxy ones need (no Ray
started; the edits to Serve's HAProxy template are tested in tests/integration/test_local_ray_env.py)."""

from __future__ import annotations

import socket

import pytest

from deployments.local_ray import DIRECT_INGRESS_PORTS, free_port_range, serving_path_env


def test_direct_ingress_listens_on_the_given_port_first():
    env = serving_path_env("direct", 8000)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    # Serve hands out ports lowest first from [min, max): the first ingress replica gets 8000.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == \
        ("8000", str(8000 + DIRECT_INGRESS_PORTS))
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"


def test_haproxy_fronts_direct_ingress_replicas_that_let_go_of_their_ports_quickly():
    env = serving_path_env("haproxy", 8000)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8000"
    # Serve's 30 s drain held every shutdown and every replaced ingress for 30 s.
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) <= 5
    assert serving_path_env("direct", 8000)["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_the_proxy_path_turns_off_what_the_others_turn_on():
    # One process can start Ray twice (tests do): the second start must not inherit the first's.
    haproxy, direct, proxy = serving_path_env("haproxy", 8000), serving_path_env("direct", 8000), serving_path_env("proxy")
    assert set(proxy) <= set(direct) <= set(haproxy)
    assert proxy == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                     "RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}


@pytest.mark.parametrize("path, port", [("direct", None), ("direct", 0), ("direct", 65535), ("haproxy", None),
                                        ("nginx", 8000)])
def test_a_bad_serving_path_or_port_is_refused(path, port):
    with pytest.raises(ValueError):
        serving_path_env(path, port)


def test_a_free_port_range_is_free_throughout():
    first = free_port_range(DIRECT_INGRESS_PORTS)
    for port in range(first, first + DIRECT_INGRESS_PORTS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
