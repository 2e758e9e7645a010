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
