"""init_local_ray's Serve settings for a machine whose cores the engine shares (ray.init faked), and
its edits to Serve's HAProxy template."""

from __future__ import annotations

import os

import pytest

from deployments.local_ray import serving_path_env


@pytest.mark.parametrize("preset, expected", [(None, "0.5"), ("0.1", "0.1")])
def test_serves_control_loop_is_slowed_for_a_shared_machine_unless_the_environment_says(monkeypatch, preset, expected):
    import ray

    from deployments import http_guard, local_ray

    started = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.append(kwargs))
    # Whatever init_local_ray sets is put back after the test.
    for name in [*local_ray.SHARED_MACHINE_ENV, *local_ray.FAULT_ENV, *local_ray.LOOPBACK_ENV, *serving_path_env("proxy"),
                 http_guard.CALLBACK_ENV]:
        monkeypatch.delenv(name, raising=False)
    if preset is not None:
        monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", preset)
    local_ray.init_local_ray("proxy")
    assert started and os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == expected
    assert os.environ["RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS"] == "1"
    local_ray.restore_environment()


def test_each_start_takes_its_own_environment_and_leaves_none_behind(monkeypatch):
    """A process that starts Ray several times (the tests do, some with plain ray.init) gets each
    start's serving path and limits, not an earlier one's; a value the user set is kept; and
    restore_environment puts back what was there."""
    import ray

    from deployments import http_guard, local_ray

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    names = [*local_ray.SHARED_MACHINE_ENV, *local_ray.FAULT_ENV, *local_ray.LOOPBACK_ENV, *serving_path_env("haproxy", 8000),
             *local_ray.haproxy_env(), "ITERSERVE_HTTP_HEADER_TIMEOUT_S", http_guard.CALLBACK_ENV]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_NBTHREAD", "3")
    local_ray.init_local_ray("haproxy", 8000)
    assert os.environ["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == "30"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    local_ray.restore_environment()
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ and "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S" not in os.environ
    assert os.environ["RAY_SERVE_HAPROXY_NBTHREAD"] == "3"
    monkeypatch.setenv("ITERSERVE_HTTP_HEADER_TIMEOUT_S", "2")
    local_ray.init_local_ray("haproxy", 8000)
    assert os.environ["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == "6"
    assert os.environ["RAY_SERVE_HAPROXY_NBTHREAD"] == "3"
    local_ray.restore_environment()


def test_haproxys_listeners_go_on_loopback_and_it_closes_idle_and_slow_connections():
    """Serve's template binds HAProxy's stats page and exporter to every interface and leaves a
    connection that never completes a request open for an hour; the edited one does neither."""
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    from deployments.local_ray import haproxy_template

    edited = haproxy_template(HAPROXY_CONFIG_TEMPLATE, header_timeout_s=2.5)
    binds = [line.strip()[len("bind "):] for line in edited.splitlines() if line.strip().startswith("bind ")]
    assert binds and all(b.startswith(("127.0.0.1:", "{{ config.frontend_host }}", "{{ config.grpc_frontend_host }}"))
                         for b in binds), binds
    assert "timeout http-request 2500ms" in edited and "timeout http-keep-alive 2500ms" in edited
    with pytest.raises(ValueError, match="changed"):  # a template that lacks a line to edit is refused
        haproxy_template(HAPROXY_CONFIG_TEMPLATE.replace("bind *:", "bind 0.0.0.0:"), header_timeout_s=2.5)
