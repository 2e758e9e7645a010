"""One short simulated run against the same requests through the real engine.

The step-time profile is measured here, on the machine the test runs on (a shipped profile
describes the machine it was measured on), from the tiny model's runner: a quick grid of step
shapes and the steps of a short real run of other requests. The engine and the simulator then
serve the same Azure-trace requests, and the simulated TTFT p50 and TPOT p50 must be within 40% of
the real ones, and throughput within 10%. The bound is wide because the real engine's TPOT moves
from run to run on a small shared machine while the simulation is deterministic (docs/simulator.md,
'Validation against the real engine'). It still fails a simulator that is off by a factor, or
whose steps, batching or admission differ from the engine's.

A shared machine's speed also drifts, by up to 2x within an hour (docs/simulator.md, 'Scale'), so
a profile measured minutes before a real run can predict a TPOT half the real one. So an attempt
measures the profile again right before its real run, and the test makes at most ATTEMPTS of them:
it passes on the first attempt within every bound and fails when none is. A simulator that is
wrong is wrong in every attempt; a machine that changed speed mid-attempt rarely does so three
times running.
"""

from __future__ import annotations

import pytest

from simulator.validation import bench
pytestmark = pytest.mark.integration

BOUNDS = {"ttft_p50_s": 0.4, "tpot_p50_s": 0.4, "output_tokens_per_s": 0.1}
ATTEMPTS = 3


def attempt() -> dict:
    """Measure a profile here and now, then compare one real run with its simulation."""
    args = bench.parse_args(["--quick", "--validation-requests", "60"])  # --validation-profile here
    return bench.validation(args, bench.validation_profile(args))


def out_of_bounds(result: dict) -> list[str]:
    errors = result["rel_error"]
    return [key for key, bound in BOUNDS.items() if errors[key] is None or errors[key] > bound]


def test_short_simulated_run_matches_the_real_engine(tiny_model_dir):
    failed = []
    for _ in range(ATTEMPTS):
        result = attempt()
        missed = out_of_bounds(result)
        if not missed:
            return
        failed.append((missed, result["real"], result["sim"]))
    pytest.fail(f"every attempt out of bounds {BOUNDS}: {failed}")


def test_out_of_bounds_names_each_figure_past_its_bound():
    errors = {"ttft_p50_s": 0.39, "tpot_p50_s": 0.41, "output_tokens_per_s": None}
    assert out_of_bounds({"rel_error": errors}) == ["tpot_p50_s", "output_tokens_per_s"]
