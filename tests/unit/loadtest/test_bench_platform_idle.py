"""bench_platform_idle's parts that need no Ray: the split of its flags from the workload's, the
summary of its rounds, and the stop-and-continue of a process tree."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from loadtest.benchmarks import bench_platform_idle as bpi


def test_its_own_flags_are_split_from_the_workload_flags_and_bad_ones_fail_early():
    args, rest = bpi.parse_args(["--rounds", "2", "--dtype", "float32", "--quick"])
    assert args.rounds == 2 and rest == ["--dtype", "float32", "--quick"]
    with pytest.raises(SystemExit):
        bpi.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):  # a workload flag's error, caught before any Ray starts
        bpi.parse_args(["--rate", "0"])


def test_summary_takes_medians_per_turn_and_the_idle_over_stopped_ratios():
    def figures(tok_s, tpot_ms, step_ms):
        return {"tokens_per_s": tok_s, "tpot_p50_ms": tpot_ms, "decode_step_ms": step_ms, "ttft_p50_ms": 100.0}

    rounds = [{"stopped": figures(600, 15, 13), "idle": figures(500, 18, 16)},
              {"stopped": figures(580, 16, 14), "idle": figures(480, 19, 17)},
              {"stopped": figures(620, 14, 12), "idle": figures(400, 30, 15)}]
    out = bpi.summarize(rounds)
    assert out["median"]["stopped"]["tokens_per_s"] == 600 and out["median"]["idle"]["tokens_per_s"] == 480
    assert out["idle_over_stopped_tokens_per_s"] == pytest.approx(0.8)
    assert out["idle_over_stopped_tpot"] == pytest.approx(19 / 15)
    assert out["idle_over_stopped_decode_step"] == pytest.approx(16 / 13)


def test_cpu_by_name_sums_processes_of_a_name_as_shares_of_a_core():
    names = {1: "raylet", 2: "ray::IDLE", 3: "ray::IDLE", 4: "gone"}
    shares = bpi.cpu_by_name(names, {1: 0.5, 2: 0.2, 3: 0.4}, wall_s=10.0)
    assert shares == {"ray::IDLE": pytest.approx(0.06), "raylet": pytest.approx(0.05)}
    assert list(shares) == ["ray::IDLE", "raylet"]


def test_python_processes_are_labelled_by_their_script():
    assert bpi.process_label("python3.11", ["/x/python3.11", "-u", "/ray/_private/log_monitor.py", "--a"]) == \
        "python log_monitor.py"
    assert bpi.process_label("python", ["python", "-c", "import x"]) == "python -c"
    assert bpi.process_label("raylet", ["/ray/raylet", "--x"]) == "raylet"


def _eventually(check, timeout_s: float = 10.0) -> bool:
    """A signal is delivered asynchronously: poll for its effect."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_whole_tree_is_found_stopped_for_the_block_and_continued_after_it_even_on_error():
    # A child that starts a grandchild: descendants() must find both, as it finds a Ray's workers.
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 20
        while len([p for p in bpi.descendants() if p != child.pid]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = bpi.descendants()
        assert child.pid in tree and len(tree) >= 2
        with pytest.raises(RuntimeError), bpi.stopped(list(tree)):
            assert _eventually(lambda: all(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pid in tree))
            raise RuntimeError("a failed turn")
        assert _eventually(lambda: all(psutil.Process(pid).status() != psutil.STATUS_STOPPED for pid in tree))
    finally:
        for proc in psutil.Process(child.pid).children(recursive=True):
            proc.kill()
        child.kill()
        child.wait(10)
