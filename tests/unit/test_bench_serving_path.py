"""bench_serving_path's pure parts: py-spy's collapsed stacks into shares, and the engine-side
means from two scrapes of the replicas' histograms."""

from __future__ import annotations

import pytest

from loadtest.bench_serving_path import _delta_mean, top_functions


def test_collapsed_stacks_give_self_and_inclusive_shares(tmp_path):
    path = tmp_path / "stacks.txt"
    path.write_text("thread;run (a.py:1);step (b.py:2);forward (c.py:3) 6\n"
                    "thread;run (a.py:1);step (b.py:2) 2\n"
                    "thread;loop (d.py:9) 2\n"
                    "garbage line\n")
    top = top_functions(path)
    assert top["samples"] == 10
    assert dict(top["self"]) == {"forward": 0.6, "step": 0.2, "loop": 0.2}
    assert dict(top["inclusive"])["step"] == 0.8 and dict(top["inclusive"])["thread"] == 1.0


def test_a_missing_profile_says_so_instead_of_raising(tmp_path):
    assert top_functions(tmp_path / "none.txt")["samples"] == 0


def test_engine_side_means_come_from_the_difference_of_two_scrapes():
    before = {"itl_s": (10.0, 100.0), "ttft_s": (5.0, 10.0)}
    after = {"itl_s": (14.0, 120.0), "ttft_s": (5.0, 10.0)}
    assert _delta_mean(before, after, "itl_s") == pytest.approx(0.2)
    assert _delta_mean(before, after, "ttft_s") is None  # nothing observed in between
