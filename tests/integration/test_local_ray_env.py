"""init_local_ray's Serve settings for a machine whose cores the engine shares (ray.init faked)."""

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
    for name in [*local_ray.SHARED_MACHINE_ENV, *local_ray.LOOPBACK_ENV, *serving_path_env("proxy"),
                 http_guard.CALLBACK_ENV]:
        monkeypatch.delenv(name, raising=False)
    if preset is not None:
        monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", preset)
    local_ray.init_local_ray("proxy")
    assert started and os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == expected
