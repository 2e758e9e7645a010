"""simulator.validation.fingerprint: equal runs give equal lines, and the lines see a changed result."""

from __future__ import annotations

import pytest

from simulator.validation import fingerprint as fp
from simulator.cluster import ClusterConfig, SimCluster
from loadtest.traces import BenchRequest


def test_the_same_runs_give_the_same_lines(capsys):
    lines = fp.main(["--requests", "6"])
    assert len(lines) == 7 and capsys.readouterr().out.splitlines() == lines
    assert fp.fingerprint(6) == lines


def test_a_different_result_gives_a_different_digest():
    class Steps:
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def predict(self, batch) -> float:
            return self.seconds

    workload = [BenchRequest("a", tuple(range(1, 40)), 5, 0.0)]
    runs = [SimCluster(ClusterConfig(), Steps(s)).run(workload) for s in (0.01, 0.01, 0.02)]
    assert fp.digest(runs[0]) == fp.digest(runs[1]) != fp.digest(runs[2])


def test_fingerprint_refuses_no_requests():
    with pytest.raises(SystemExit, match="--requests must be >= 1"):
        fp.main(["--requests", "0"])
