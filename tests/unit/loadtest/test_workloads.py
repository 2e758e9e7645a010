"""Serving workloads: length distributions, trace replay, shared prefixes (counted with the engine's
own block hashes), multi-turn conversations and priority mixes."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest import workloads as wl
from loadtest.traces import LengthScaler, TraceRow
from model_worker.sched.hashing import hash_prompt_blocks

POOL = np.arange(10, 1000)
BLOCK = 16


def test_length_distributions_stay_in_bounds_and_are_seeded():
    rng = lambda: np.random.default_rng(3)  # noqa: E731
    assert wl.LengthDist("fixed", 40, 1, 100).sample(5, rng()) == [40] * 5
    uniform = wl.LengthDist("uniform", 50, 10, 90).sample(2000, rng())
    assert min(uniform) == 10 and max(uniform) == 90
    lognormal = wl.LengthDist("lognormal", 100, 8, 400, sigma=0.6).sample(5000, rng())
    assert 8 <= min(lognormal) and max(lognormal) <= 400
    assert 90 <= np.median(lognormal) <= 110  # the median of a lognormal is exp(mu) = mean here
    assert lognormal == wl.LengthDist("lognormal", 100, 8, 400, sigma=0.6).sample(5000, rng())


@pytest.mark.parametrize("kwargs", [{"kind": "normal"}, {"low": 0}, {"mean": 2000}, {"sigma": 0}])
def test_bad_length_distributions_are_refused(kwargs):
    with pytest.raises(ValueError):
        wl.LengthDist(**kwargs)


def test_arrival_patterns():
    assert wl.arrivals(4, None, "poisson", 0) == [0.0] * 4
    assert wl.arrivals(4, 5.0, "burst", 0) == [0.0] * 4
    poisson = wl.arrivals(4000, 10.0, "poisson", 0)
    assert poisson[0] == 0.0 and (len(poisson) - 1) / poisson[-1] == pytest.approx(10.0, rel=0.05)
    gaps = np.diff(wl.arrivals(4000, 10.0, "gamma", 0, cv=3.0))
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(3.0, rel=0.15)
    with pytest.raises(ValueError, match="poisson, gamma or burst"):
        wl.arrivals(3, 1.0, "uniform", 0)


def test_synthetic_prompts_have_exactly_the_asked_lengths():
    prompt, output = wl.LengthDist("uniform", 50, 5, 120), wl.LengthDist("fixed", 7, 7, 7)
    times = wl.arrivals(50, 4.0, "poisson", 1)
    workload = wl.synthetic(50, prompt, output, times, POOL, seed=9)
    expected_lengths = prompt.sample(50, np.random.default_rng(9))
    by_id = {r.request_id: r for r in workload}
    assert [len(by_id[f"req-{i}"].prompt_token_ids) for i in range(50)] == expected_lengths
    assert all(r.output_tokens == 7 for r in workload)
    assert [r.arrival_s for r in workload] == sorted(times)
    assert workload == wl.synthetic(50, prompt, output, times, POOL, seed=9)


def test_trace_replay_keeps_order_scales_time_and_lengths():
    rows = [TraceRow(0.0, 400, 100), TraceRow(2.0, 800, 30), TraceRow(3.0, 4000, 900), TraceRow(7.0, 12, 2)]
    scaler = LengthScaler(prompt_divisor=4, prompt_min_tokens=8, prompt_max_tokens=512, output_divisor=2,
                          output_min_tokens=4, output_max_tokens=256)
    workload = wl.trace_replay(rows, 3, POOL, seed=0, speedup=2.0, scaler=scaler, start_row=1)
    assert [r.arrival_s for r in workload] == [0.0, 0.5, 2.5]
    assert [len(r.prompt_token_ids) for r in workload] == [200, 512, 8]
    assert [r.output_tokens for r in workload] == [15, 256, 4]
    assert wl.trace_rate(rows, 4) == pytest.approx(3 / 7.0)
    with pytest.raises(ValueError, match="rows"):
        wl.trace_replay(rows, 5, POOL, seed=0)


def test_shared_prefix_requests_share_exactly_their_prefix_blocks():
    k, per_prefix, prefix_tokens, suffix_tokens = 3, 5, 4 * BLOCK, 2 * BLOCK
    workload = wl.shared_prefix(k, per_prefix, prefix_tokens, suffix_tokens, 8, [0.0] * (k * per_prefix), POOL, 1)
    hashes = [hash_prompt_blocks(list(r.prompt_token_ids), BLOCK) for r in workload]
    assert all(len(h) == 6 for h in hashes)
    # The four prefix blocks: one chain per system prompt, shared by its five requests.
    prefix_chains = {tuple(h[:4]) for h in hashes}
    assert len(prefix_chains) == k
    for chain in prefix_chains:
        assert sum(tuple(h[:4]) == chain for h in hashes) == per_prefix
    # Suffix blocks are each request's own: nothing else is shared.
    suffix_blocks = [b for h in hashes for b in h[4:]]
    assert len(set(suffix_blocks)) == len(suffix_blocks)
    distinct = len({b for h in hashes for b in h})
    assert distinct == k * 4 + len(workload) * 2  # 90 blocks sent, 42 distinct


def test_multi_turn_prompts_extend_the_previous_turn():
    workload = wl.multi_turn(2, 3, system_tokens=2 * BLOCK, user_tokens=BLOCK, answer_tokens=BLOCK,
                             arrivals_s=[0.0, 1.0], token_pool=POOL, seed=4, think_time_s=0.25)
    by_id = {r.request_id: r for r in workload}
    for c in range(2):
        turns = [by_id[f"conv-{c}-turn-{t}"] for t in range(3)]
        assert [r.after_id for r in turns] == [None, f"conv-{c}-turn-0", f"conv-{c}-turn-1"]
        assert [r.arrival_s for r in turns] == [float(c), 0.25, 0.25]
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt_token_ids[:len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
            assert len(later.prompt_token_ids) == len(earlier.prompt_token_ids) + 2 * BLOCK
            old, new = (hash_prompt_blocks(list(r.prompt_token_ids), BLOCK) for r in (earlier, later))
            assert new[:len(old)] == old  # every block of the last turn is a cache hit for the next
    assert by_id["conv-0-turn-0"].prompt_token_ids != by_id["conv-1-turn-0"].prompt_token_ids


def test_batch_fraction_tags_exactly_that_share():
    workload = wl.synthetic(40, wl.LengthDist("fixed", 8, 8, 8), wl.LengthDist("fixed", 4, 4, 4), [0.0] * 40, POOL, 0)
    tagged = wl.with_batch_fraction(workload, 0.25, seed=5)
    assert sum(r.priority == "batch" for r in tagged) == 10
    assert [r.request_id for r in tagged] == [r.request_id for r in workload]
    assert tagged == wl.with_batch_fraction(workload, 0.25, seed=5)
    with pytest.raises(ValueError):
        wl.with_batch_fraction(workload, 1.5, seed=0)


def test_step_arrivals_follow_each_phase_rate():
    from loadtest.workloads import step_arrivals

    times = step_arrivals([(100.0, 1.0), (100.0, 4.0), (100.0, 0.0), (100.0, 1.0)], seed=3)
    counts = [sum(1 for t in times if k * 100 <= t < (k + 1) * 100) for k in range(4)]
    assert 70 <= counts[0] <= 130 and 340 <= counts[1] <= 460 and counts[2] == 0 and 70 <= counts[3] <= 130
    assert times == sorted(times) and times[-1] < 400
    assert step_arrivals([(100.0, 1.0)], seed=3) == [t for t in times if t < 100]  # phases are independent
    with pytest.raises(ValueError, match="phase 1"):
        step_arrivals([(10.0, 1.0), (0.0, 1.0)], seed=0)
