"""The scaling decision on fake replica loads and a fake clock (the times passed in)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable

import pytest

from autoscaler.policy import (AutoscalerConfig, AutoscalerState, ReplicaLoad, decide, state_from_dict,
                               to_dict)

Load = Callable[[float, int], list[ReplicaLoad]]


def replicas(num: int, waiting: int = 0, running: int = 0, ttft_s: float | None = None,
             oldest_wait_s: float = 0.0, kv: float = 0.0) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", waiting, running, ttft_s, oldest_wait_s, kv) for i in range(num)]


def spread_over(total_waiting: int, num: int, running: int = 0, ttft_s: float | None = None) -> list[ReplicaLoad]:
    """`total_waiting` requests shared as evenly as a router would over `num` replicas."""
    base, extra = divmod(total_waiting, num)
    return [ReplicaLoad(f"r{i}", base + (i < extra), running, ttft_s) for i in range(num)]


def spread(total_waiting: int, **kwargs) -> Load:
    """A fixed offered load over every replica asked for, each ready at once."""
    return lambda now_s, target: spread_over(total_waiting, target, **kwargs)


def run(config: AutoscalerConfig, load: Load | list[ReplicaLoad], times: Iterable[float], target: int) -> list[int]:
    """Decide at each time as Serve would: the count returned is the next target, and the state
    lives in Serve's policy-state dict between calls (through JSON, beside Serve's own keys).
    Returns the replica count asked for after each decision."""
    stored: dict = {"serve_internal": {"last_target": target}}
    counts = []
    for now_s in times:
        loads = load(now_s, target) if callable(load) else load
        decision = decide(loads, target, now_s, config, state_from_dict(stored))
        target = decision.num_replicas
        stored = json.loads(json.dumps({**stored, **to_dict(decision.state)}))
        counts.append(target)
    return counts


def changes(counts: list[int]) -> list[tuple[int, int]]:
    """(index, +1 or -1) for each change of the count; with 1 s ticks from 0 the index is the time."""
    return [(i, 1 if b > a else -1) for i, (a, b) in enumerate(zip(counts, counts[1:]), 1) if a != b]


def reversals(counts: list[int]) -> int:
    directions = [direction for _, direction in changes(counts)]
    return sum(a != b for a, b in zip(directions, directions[1:]))


def test_queue_over_target_scales_up_after_the_delay_not_before():
    config = AutoscalerConfig()  # 2 s delay, 4 waiting per replica
    # 12 waiting: 6 per replica on 2 (pressure 1.5, under panic), 4 per replica (on target) on 3.
    assert run(config, spread(12), [0, 1, 1.9, 2, 3, 10, 60], target=2) == [2, 2, 2, 3, 3, 3, 3]
    slow = AutoscalerConfig(scale_up_delay_s=10)
    assert run(slow, spread(12), range(12), target=2) == [2] * 10 + [3, 3]
    # The pressure must hold throughout: one sample on target at 1.5 s restarts the clock.
    dip: Load = lambda now_s, target: replicas(2, waiting=4 if now_s == 1.5 else 6)
    assert run(config, dip, [0, 1, 1.5, 2, 3, 3.5, 4], target=2) == [2, 2, 2, 2, 2, 2, 3]
    decision = decide(replicas(2, waiting=6), 2, 2.0, config, AutoscalerState(2, pressure_since_s=0.0))
    assert (decision.num_replicas, decision.reason) == (3, "up: 6.0 waiting/replica over target 4")


def test_ttft_over_slo_scales_up_and_so_does_the_age_of_the_oldest_waiting_request():
    config = AutoscalerConfig()
    # Barely a queue (1 waiting per replica) but first tokens take 1.5 s at p90; on 3 replicas 0.8 s.
    slow_first_tokens: Load = lambda now_s, target: replicas(target, waiting=1, ttft_s=1.5 if target == 2 else 0.8)
    assert run(config, slow_first_tokens, [0, 1, 2, 3, 30], target=2) == [2, 2, 3, 3, 3]
    # No first token in the window at all (p90 None), yet the oldest request has waited 1.6 s:
    # the queue time is seen before any first token comes out. ceil(2 * 1.6) = 4.
    stuck = replicas(2, waiting=1, running=8, ttft_s=None, oldest_wait_s=1.6)
    assert run(config, stuck, [0, 1, 2], target=2) == [2, 2, 4]
    assert run(config, replicas(2, waiting=1, running=8, ttft_s=None), [0, 1, 2, 3], target=2) == [2, 2, 2, 2]
    decision = decide(stuck, 2, 2.0, config, AutoscalerState(2, pressure_since_s=0.0))
    assert decision.reason == "up: ttft 1.60 s over slo 1 s"


def test_kv_nearly_full_counts_only_with_requests_waiting():
    config = AutoscalerConfig()
    # 98% full with a request waiting on each: pressure 0.98 / 0.95 > 1, so one more replica.
    assert run(config, replicas(2, waiting=1, running=30, kv=0.98), [0, 1, 2], target=2) == [2, 2, 3]
    # Just as full with nothing waiting is a well-packed batch: no scale-up, and no scale-down.
    assert run(config, replicas(2, running=30, kv=0.98), range(0, 120), target=2) == [2] * 120


def test_panic_scales_at_once_bounded_by_the_factor_and_max_replicas():
    config = AutoscalerConfig(max_scale_up_factor=2.0)  # panic at 2, at most 2x per decision
    assert run(config, replicas(2, waiting=20), [0], target=2) == [4]  # pressure 5, capped at 2x
    assert run(config, replicas(2, waiting=8), [0], target=2) == [4]  # exactly the threshold
    assert run(config, replicas(2, waiting=7), [0, 1, 2], target=2) == [2, 2, 4]  # 1.75 waits the delay
    assert run(AutoscalerConfig(max_replicas=3), replicas(2, waiting=20), [0], target=2) == [3]
    # A huge burst doubles once per decision as replicas come up, and stops at max_replicas.
    assert run(config, spread(80), [0, 1, 2, 3, 4], target=1) == [2, 4, 8, 8, 8]
    assert decide(replicas(2, waiting=20), 2, 0.0, config).reason == "panic: 20.0 waiting/replica over target 4"


def test_a_surge_is_sized_by_the_seats_it_occupies():
    # One replica holds 4 running and has 12 waiting: the queue ratio (12 / 4 = 3) says 3 replicas,
    # the seats say 16 / 4 = 4, and one decision asks for 4 (the default factor allows 4x).
    surge = [ReplicaLoad("r0", 12, 4, None)]
    decision = decide(surge, 1, 0.0, AutoscalerConfig())
    assert decision.num_replicas == 4 and decision.reason.startswith("panic")
    # Bounded by the factor: 40 waiting would seat on 11, but one decision goes to 4x at most.
    assert decide([ReplicaLoad("r0", 40, 4, None)], 1, 0.0, AutoscalerConfig()).num_replicas == 4
    assert decide([ReplicaLoad("r0", 40, 4, None)], 1, 0.0, AutoscalerConfig(max_scale_up_factor=2.0)).num_replicas == 2
    # Without a queue anywhere, seats say nothing: a TTFT breach alone scales proportionally.
    slow = [ReplicaLoad(f"r{i}", 0, 2, 1.5) for i in range(2)]
    assert decide(slow, 2, 0.0, AutoscalerConfig(scale_up_delay_s=0)).num_replicas == 3


def test_no_more_replicas_while_those_asked_for_are_still_loading():
    config = AutoscalerConfig(max_scale_up_factor=2.0)
    # 24 waiting in all. The replicas asked for at t=0 load weights for a minute; meanwhile only
    # the first two report, with 12 waiting each (pressure 3: panic) at every sample.
    def load(now_s: float, target: int) -> list[ReplicaLoad]:
        return spread_over(24, 2 if now_s < 60 else target)

    counts = run(config, load, range(64), target=2)
    assert counts[:61] == [4] * 61
    # Once all four report (6 waiting each: 1.5), they get the full delay before the next step.
    assert counts[61:] == [6, 6, 6]
    # Replicas still loading count only for what they cover: one loading of the two needed is short.
    assert decide(replicas(2, waiting=12), 3, 0.0, config).num_replicas == 4
    held = decide(replicas(2, waiting=12), 5, 0.0, config)
    assert (held.num_replicas, held.reason) == (5, "hold: 3 asked-for replicas still loading")


def test_noise_around_the_target_never_moves_the_count():
    rng = random.Random(7)
    config = AutoscalerConfig()
    # Four replicas' worth of queue, alternating 0.6x and 1.3x of the target every second (+-5%),
    # with TTFT noise under the SLO, for ten minutes.
    def around_target(now_s: float, target: int) -> list[ReplicaLoad]:
        factor = (1.3 if int(now_s) % 2 else 0.6) * rng.uniform(0.95, 1.05)
        return spread_over(round(16 * factor), target, running=8, ttft_s=rng.uniform(0.3, 0.95))

    assert set(run(config, around_target, range(600), target=4)) == {4}
    # Every pressure anywhere between low_water and 1: the hysteresis gap, so nothing moves.
    def in_the_gap(now_s: float, target: int) -> list[ReplicaLoad]:
        ratio = rng.uniform(0.51, 0.99)
        return spread_over(round(4 * target * ratio), target, running=8, ttft_s=rng.uniform(0.51, 0.99))

    counts = run(config, in_the_gap, range(600), target=3)
    assert reversals(counts) == 0 and set(counts) == {3}


def test_noisy_load_that_drifts_is_followed_without_flapping():
    rng = random.Random(11)
    config = AutoscalerConfig()
    # The offered load drifts between 1 and 6 replicas' worth over a 10 minute period; each second
    # the queue is 0.6x or 1.3x of that (+-10%), and TTFT follows the queue per replica with noise.
    def drifting(now_s: float, target: int) -> list[ReplicaLoad]:
        worth = 1 + 2.5 * (1 - math.cos(2 * math.pi * now_s / 600))
        total = round(4 * worth * (1.3 if int(now_s) % 2 else 0.6) * rng.uniform(0.9, 1.1))
        ttft_s = 0.5 * total / target / 4 * rng.uniform(0.8, 1.2)
        return spread_over(total, target, running=8, ttft_s=ttft_s)

    counts = run(config, drifting, range(1200), target=1)
    steps = changes(counts)
    # Up with the first peak (t=300), down through the trough (t=600), up and down again.
    assert counts[300] == max(counts) >= 6 and counts[650] < counts[599] < counts[300], steps
    # Two cycles, so up, down, up, down: three reversals and never a step back within a phase.
    assert reversals(counts) == 3, steps
    downs = [t for t, direction in steps if direction < 0]
    ups = [t for t, direction in steps if direction > 0]
    assert not any(d < u < d + config.scale_down_delay_s for d in downs for u in ups), steps
    # Down is one replica per 30 s; up may skip counts. About ten changes per cycle at most.
    assert all(b - a >= -1 for a, b in zip(counts, counts[1:])) and len(steps) <= 20, steps
    assert all(later - earlier >= config.scale_down_delay_s for earlier, later in zip(downs, downs[1:]))


def test_bursts_with_short_gaps_keep_the_replicas():
    config = AutoscalerConfig()
    # 20 s bursts of 24 waiting, with 20 s idle gaps: shorter than the 30 s scale-down delay.
    bursts: Load = lambda now_s, target: spread_over(24 if now_s % 40 < 20 else 0, target)
    counts = run(config, bursts, range(400), target=2)
    assert all(b >= a for a, b in zip(counts, counts[1:])) and counts[-1] == 6, changes(counts)


def test_warm_spares_are_kept_beyond_demand():
    config = AutoscalerConfig(min_replicas=1, warm_spares=1)
    idle: Load = lambda now_s, target: replicas(target)
    # Serve starts at min_replicas; the first decision adds the spare, which idleness never removes.
    assert run(config, idle, range(0, 300, 10), target=1) == [2] * 30
    # 12 waiting over the 2 (1.5): the load needs ceil(2 * 1.5) = 3, and the spare goes on top.
    under_load = decide(replicas(2, waiting=6), 2, 2.0, config, AutoscalerState(1, pressure_since_s=0.0))
    assert (under_load.num_replicas, under_load.state.demand) == (4, 3)
    assert run(config, spread(12), [0, 1, 2, 3, 10], target=2) == [2, 2, 4, 4, 4]
    # When the load goes, back to min_replicas plus the spare, not to min_replicas.
    gone = lambda now_s, target: spread_over(12 if now_s < 3 else 0, target)
    assert run(config, gone, [0, 1, 2, 3, 32.9, 33, 100], target=2) == [2, 2, 4, 4, 4, 2, 2]
    # max_replicas bounds the total, spares included.
    assert run(AutoscalerConfig(max_replicas=3, warm_spares=1), replicas(2, waiting=20), [0], target=2) == [3]


def test_scale_down_waits_the_delay_and_steps_one_replica_at_a_time():
    config = AutoscalerConfig()  # 30 s
    light: Load = lambda now_s, target: replicas(target, running=1, ttft_s=0.2)
    times = [0, 29.9, 30, 59.9, 60, 89.9, 90, 119.9, 120, 400]
    assert run(config, light, times, target=4) == [4, 4, 3, 3, 2, 2, 1, 1, 1, 1]
    at_least_two = AutoscalerConfig(min_replicas=2)
    assert run(at_least_two, light, times, target=4) == [4, 4, 3, 3, 2, 2, 2, 2, 2, 2]
    # One sample that is not calm (a 0.6 s TTFT) at 20 s: the 30 s start again at the next, 21 s.
    blip: Load = lambda now_s, target: replicas(target, running=1, ttft_s=0.6 if now_s == 20 else 0.2)
    assert run(config, blip, [0, 20, 21, 30, 50.9, 51], target=4) == [4, 4, 4, 4, 4, 3]
    assert decide(replicas(4, running=1), 4, 30.0, config, AutoscalerState(4, calm_since_s=0.0)).reason \
        == "down: calm for 30 s"


def test_idle_goes_straight_to_min_and_the_bounds_always_hold():
    idle: Load = lambda now_s, target: replicas(target)
    assert run(AutoscalerConfig(), idle, [0, 29.9, 30, 400], target=5) == [5, 5, 1, 1]
    assert run(AutoscalerConfig(min_replicas=2), idle, [0, 29.9, 30, 400], target=5) == [5, 5, 2, 2]
    # A target over max_replicas (a lowered max) is brought down at once; panic cannot pass it.
    capped = AutoscalerConfig(max_replicas=3)
    assert run(capped, replicas(3, waiting=40), range(60), target=5) == [3] * 60
    # Nothing reporting: hold the target within bounds, and let Serve scale up from zero itself.
    assert decide([], 0, 0.0, AutoscalerConfig()).num_replicas == 1
    assert decide([], 0, 0.0, AutoscalerConfig(min_replicas=0)).num_replicas == 0
    assert decide([], 3, 0.0, AutoscalerConfig()).num_replicas == 3


def test_no_scale_down_within_the_delay_after_a_scale_up():
    config = AutoscalerConfig(max_scale_up_factor=2.0)
    # Panic to 4 at t=0, then the load vanishes: calm from t=1, but nothing goes before t=31.
    vanishing: Load = lambda now_s, target: replicas(target, waiting=20 if now_s == 0 else 0)
    assert run(config, vanishing, [0, 1, 30, 30.9, 31, 40], target=2) == [4, 4, 4, 4, 1, 1]
    # Even a state that claims 40 s of calm waits out the 30 s since the scale-up it records.
    state = AutoscalerState(demand=4, calm_since_s=0.0, last_scale_up_s=30.0)
    held = decide(replicas(4), 4, 40.0, config, state)
    assert held.num_replicas == 4
    assert decide(replicas(4), 4, 60.0, config, held.state).num_replicas == 1


@pytest.mark.parametrize("field, value", [
    ("min_replicas", -1), ("min_replicas", 1.5), ("max_replicas", 0), ("max_replicas", True),
    ("warm_spares", -1), ("target_queue_per_replica", 0), ("ttft_slo_s", 0.0), ("scale_up_delay_s", -1),
    ("panic_threshold", 1.0), ("max_scale_up_factor", 1), ("scale_down_delay_s", float("nan")),
    ("low_water", 0), ("low_water", 1.0), ("kv_high", 1.5), ("kv_high", "0.9"),
])
def test_bad_config_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AutoscalerConfig(**{field: value})


def test_max_below_min_is_refused():
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscalerConfig(min_replicas=3, max_replicas=2)


def test_state_round_trips_through_json_beside_other_keys():
    state = AutoscalerState(demand=3, pressure_since_s=12.5, calm_since_s=None, last_scale_up_s=7.0)
    stored = json.loads(json.dumps({**to_dict(state), "serve_internal": [1, {"x": 2}]}))
    assert state_from_dict(stored) == state
    assert state_from_dict(to_dict(AutoscalerState())) == AutoscalerState()
    # The pressure clock survives the trip: 1.5 s held before, 0.5 s more now makes the delay.
    decision = decide(replicas(2, waiting=6), 2, 14.5, AutoscalerConfig(), state_from_dict(stored))
    assert decision.num_replicas == 4  # ceil(2 * 1.5) = 3 < demand + 1


@pytest.mark.parametrize("garbage", [
    None, "demand=3", [], {}, {"other": 1}, {"demand": "3"}, {"demand": -1}, {"demand": 2.5}, {"demand": True},
    {"demand": 2, "calm_since_s": "soon"}, {"demand": 2, "pressure_since_s": float("nan")},
])
def test_a_missing_or_garbled_state_is_the_default(garbage):
    assert state_from_dict(garbage) == AutoscalerState()
    # ...which takes demand from the target: three idle replicas just stay three.
    assert decide(replicas(3), 3, 0.0, AutoscalerConfig(), state_from_dict(garbage)).num_replicas == 3


def test_spares_that_take_load_are_replaced_before_a_queue_builds():
    # Demand 2 plus a spare, 4 seats each. Running requests fill 11 seats: 3 replicas' worth, so
    # the spare is serving demand. With no request waiting, the count still grows to keep a spare,
    # after the scale-up delay (3 / 2 = 1.5 is under the panic threshold).
    config = AutoscalerConfig(warm_spares=1, scale_up_delay_s=2.0)
    busy: Load = lambda now_s, target: [ReplicaLoad(f"r{i}", 0, n, 0.1, num_seats=4) for i, n in enumerate((4, 4, 3))]
    assert run(config, busy, [0, 1, 2, 3], target=3) == [3, 3, 4, 4]
    decision = decide(busy(0, 3), 3, 0.0, AutoscalerConfig(warm_spares=1, scale_up_delay_s=0))
    assert decision.reason.startswith("up: spares in use") and decision.num_replicas == 4
    # Without spares, full seats and no queue is a well-packed batch: nothing moves.
    assert run(AutoscalerConfig(scale_up_delay_s=0), busy, [0, 1, 2], target=3) == [3, 3, 3]
    # Unknown seats (0): the signal is off.
    unknown: Load = lambda now_s, target: [ReplicaLoad(f"r{i}", 0, 4, 0.1) for i in range(3)]
    assert run(config, unknown, [0, 1, 2, 3], target=3) == [3, 3, 3, 3]


def split(total: int, num: int) -> list[int]:
    base, extra = divmod(total, num)
    return [base + (i < extra) for i in range(num)]


def test_scale_down_keeps_the_busy_seats_covered():
    # Demand 3 (+1 spare), calm by the queue and TTFT, with 6 requests running on 4 seats per
    # replica: 2 replicas seat them at 75%, so one step down to demand 2, then held there however
    # long it stays calm (demand 1 would put 6 requests on 4 seats).
    config = AutoscalerConfig(warm_spares=1, scale_down_delay_s=10.0)
    calm: Load = lambda now_s, target: [ReplicaLoad(f"r{i}", 0, n, 0.1, num_seats=4)
                                        for i, n in enumerate(split(6, target))]
    counts = run(config, calm, [0, 5, 10, 15, 20, 30, 60], target=4)  # demand 4 - 1 spare = 3
    assert counts == [4, 4, 3, 3, 3, 3, 3]
    # Without spares, the same: 4 -> 3 -> 2 replicas, never 1.
    assert run(AutoscalerConfig(scale_down_delay_s=10.0), calm, [0, 10, 20, 30, 60], target=4) == [4, 3, 2, 2, 2]


def test_a_burst_that_fills_the_spares_for_a_moment_is_not_new_demand():
    # Demand 1 + 1 spare, 4 seats each; a 1 s burst runs 6 requests (2 replicas' seats), then 2.
    config = AutoscalerConfig(warm_spares=1, scale_up_delay_s=2.0)
    burst: Load = lambda now_s, target: [ReplicaLoad(f"r{i}", 0, 3 if 10 <= now_s < 11 else 1, 0.1, num_seats=4)
                                         for i in range(target)]
    assert run(config, burst, range(0, 20), target=2) == [2] * 20
    # Kept busy past the delay, it is demand: one more replica to keep a spare.
    busy: Load = lambda now_s, target: [ReplicaLoad(f"r{i}", 0, 3 if now_s >= 10 else 1, 0.1, num_seats=4)
                                        for i in range(2)]
    assert run(config, busy, range(0, 14), target=2)[-1] == 3


def test_a_momentary_gap_between_requests_is_not_idle():
    # Calm for the delay, and at this instant nothing runs, but first tokens came in the window:
    # one step down, not straight to min.
    config = AutoscalerConfig(scale_down_delay_s=10.0)
    gap = [ReplicaLoad(f"r{i}", 0, 0, 0.2) for i in range(4)]
    assert decide(gap, 4, 20.0, config, AutoscalerState(demand=4, calm_since_s=0.0)).num_replicas == 3
    quiet = [ReplicaLoad(f"r{i}", 0, 0, None) for i in range(4)]
    decision = decide(quiet, 4, 20.0, config, AutoscalerState(demand=4, calm_since_s=0.0))
    assert (decision.num_replicas, decision.reason) == (1, "idle: to min")


def test_the_seat_floor_never_turns_a_step_down_into_a_step_up():
    # Calm, demand 4, but 14 requests running on 4 seats each would want 5 replicas at 75%: hold.
    config = AutoscalerConfig(scale_down_delay_s=10.0)
    busy = [ReplicaLoad(f"r{i}", 0, n, 0.2, num_seats=4) for i, n in enumerate((4, 4, 3, 3))]
    decision = decide(busy, 4, 20.0, config, AutoscalerState(demand=4, calm_since_s=0.0))
    assert (decision.num_replicas, decision.reason) == (4, "hold: the seats are busy")
