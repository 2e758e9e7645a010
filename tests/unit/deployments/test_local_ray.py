"""The serving paths' Serve settings, the port range the direct and HAProxy ones need, and the edits
to Serve's HAProxy template (no Ray started)."""

from __future__ import annotations

import socket

import pytest

from deployments.local_ray import DIRECT_INGRESS_PORTS, free_port_range, haproxy_template, serving_path_env


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
                     "RAY_SERVE_ENABLE_HA_PROXY": "0"}


def test_haproxys_listeners_go_on_loopback_and_it_closes_idle_and_slow_connections():
    """Serve's template binds HAProxy's stats page and exporter to every interface and leaves a
    connection that never completes a request open for an hour; the edited one does neither."""
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    edited = haproxy_template(HAPROXY_CONFIG_TEMPLATE, header_timeout_s=2.5)
    binds = [line.strip()[len("bind "):] for line in edited.splitlines() if line.strip().startswith("bind ")]
    assert binds and all(b.startswith(("127.0.0.1:", "{{ config.frontend_host }}", "{{ config.grpc_frontend_host }}"))
                         for b in binds), binds
    assert "timeout http-request 2500ms" in edited and "timeout http-keep-alive 2500ms" in edited
    with pytest.raises(ValueError, match="changed"):  # a template that lacks a line to edit is refused
        haproxy_template(HAPROXY_CONFIG_TEMPLATE.replace("bind *:", "bind 0.0.0.0:"), header_timeout_s=2.5)


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
