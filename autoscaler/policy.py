"""The scaling decision: how many LLMServer replicas the load needs. Pure: standard library only,
the clock passed in.

It scales on what users feel, queueing and time to first token, not on GPU utilisation: a decoding
batch keeps the GPU busy at any load, so utilisation cannot say whether requests wait. Each signal
is a pressure, a ratio to its target (> 1: over target), over the replicas that report:

- queue: requests waiting for a first token per replica, over target_queue_per_replica.
- ttft: the mean over replicas of max(TTFT p90, age of the oldest waiting request), over
  ttft_slo_s. The age sees queueing before any first token comes out, which the TTFT of requests
  that already have one cannot.
- spares (only with warm_spares): replicas whose seats the running requests fill, over demand.
  Over 1 for scale_up_delay_s (never a panic: absorbing a burst is what spares are for), the
  spares are serving load that demand does not cover yet: scale up to keep them spare before any
  queue builds (a spare that absorbs a surge would otherwise delay its detection).
- kv: the fullest replica's KV usage over kv_high. Past kv_high it counts as over target only when
  that replica has requests waiting; otherwise it is capped at 1: a full cache with an empty queue
  is a well-packed batch, not a shortage.

pressure = the largest. The rules move `demand`, the replicas the load needs; warm spares go on top:

- up: pressure > 1 held for scale_up_delay_s, or at once when pressure >= panic_threshold (AIBrix's
  KPA panic window). The load needs the larger of ceil(reporting * pressure) and the seats it
  occupies: (running + waiting) over the running count of the replicas that have a queue, which
  are full. The queue ratio alone understates a surge (the queue it sees has only begun to build);
  the seat count sizes the backlog at once. Bounded by reporting * max_scale_up_factor (those
  reporting include any spares), and a decision adds at least one. If the replicas already
  asked for cover that (some still loading weights), hold and restart the pressure clock, so the
  loading replicas get a full delay of reports before they are judged: this stops a slow weight
  load from piling up replicas.
- down: every pressure under low_water for scale_down_delay_s, and no scale-up in the last
  scale_down_delay_s: one replica fewer (TTFT on fewer replicas cannot be predicted, so step), or
  straight to min_replicas when every replica is idle (nothing waiting or running, and no first
  token in the TTFT window); the calm clock then restarts. Not below
  the replicas that seat the running requests within down_seat_utilization of their seats:
  queues and TTFT stay low right up to the point a replica is full, so they cannot tell that one
  replica fewer would be too few.
- else hold. Nothing moves between low_water and 1: that gap, the delays and the no-down-after-up
  rule are what stop flapping.
- replicas = clamp(demand + warm_spares, min_replicas, max_replicas), and demand stays within
  [min_replicas, max_replicas]: min_replicas is the floor of demand, so an idle deployment keeps
  min_replicas + warm_spares loaded. The first decision takes demand = target - warm_spares.
- no replica reporting: hold at the target within bounds (Ray Serve scales up from zero itself).

Defaults and why: min_replicas 1, since loading weights takes far longer than any TTFT target.
max_replicas 8, a cost ceiling (one 8-GPU node). target_queue_per_replica 4: a continuous batch
admits a few waiting prefills per step, so 4 waiting clear in a step or two; more means seconds.
ttft_slo_s 1.0: chat users notice a pause past about a second. warm_spares 0: a spare costs a GPU;
set 1 when bursts must not wait for a weight load. scale_up_delay_s 2: ignores a one-sample burst,
and is short next to the minute a new replica takes to load. panic_threshold 2: twice the target
is not noise, and waiting only grows the queue (KPA panics at 200% too). max_scale_up_factor 4: a
backlog overstates the lasting load a little, but a new replica takes tens of seconds to load, so
doubling per load (1, 2, 4) absorbs a 4x step only after two loads, where one decision can size it
(docs/benchmarks.md, 'Autoscaling and admission: step load and overload').
scale_down_delay_s 30: covers the gaps between bursts, since a replica removed too early costs a
weight load when the load returns. low_water 0.5: removing one of n >= 2 replicas raises each
one's load by n / (n - 1) <= 2, so a step down from under half the target cannot itself push
pressure over 1. down_seat_utilization 0.75: a continuous batch past three quarters full starts to
queue on bursts, and stepping down on calm alone overshoots, down and then back up
(docs/benchmarks.md, 'Autoscaling and admission: step load and overload'). kv_high 0.95: past it
the engine preempts or stops admitting; below it the cache is simply well used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from contracts.checks import is_int, is_number
from contracts.reports import LoadReport

# n * (waiting / n / target) can land just over a whole number (3 * (65 / 3 / 5) is
# 13.000000000000002): ceil must not add a replica for a rounding error.
_CEIL_SLACK = 1e-9


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    replica_id: str
    # Requests admitted but still without a first token: the queue.
    num_waiting_first_token: int
    # Requests in the running batch.
    num_running: int
    # p90 time to first token over the replica's recent window; None: no first token in it.
    ttft_p90_s: float | None
    # Age of the oldest request still waiting for its first token: sees queue time that the TTFT
    # of requests that already have one cannot.
    oldest_wait_s: float = 0.0
    # Fraction of KV blocks in use, 0..1.
    kv_usage: float = 0.0
    # Requests the replica can run at once (the engine's max_num_seqs); 0: not reported.
    num_seats: int = 0

    @classmethod
    def of(cls, replica_id: str, report: LoadReport) -> ReplicaLoad:
        """What the policy reads of a replica's LoadReport (autoscaler/serve_policy.py reads the
        same fields from the report's metrics as Serve delivers them)."""
        return cls(replica_id=replica_id, num_waiting_first_token=report.num_waiting_first_token,
                   num_running=report.num_running, ttft_p90_s=report.ttft_p90_s, oldest_wait_s=report.oldest_wait_s,
                   kv_usage=report.kv_usage, num_seats=report.num_seats)


# (field, test, what the test asks) for each number in the config; NaN fails every test.
_CHECKS = (
    ("target_queue_per_replica", lambda v: v > 0, "> 0"),
    ("ttft_slo_s", lambda v: v > 0, "> 0"),
    ("scale_up_delay_s", lambda v: v >= 0, ">= 0"),
    ("panic_threshold", lambda v: v > 1, "> 1"),
    ("max_scale_up_factor", lambda v: v > 1, "> 1"),
    ("scale_down_delay_s", lambda v: v >= 0, ">= 0"),
    ("low_water", lambda v: 0 < v < 1, "in (0, 1)"),
    ("kv_high", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("down_seat_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
)


@dataclass(slots=True, frozen=True)
class AutoscalerConfig:
    # Each default's reason is in the module docstring, next to the rule it tunes.
    min_replicas: int = 1
    max_replicas: int = 8
    target_queue_per_replica: float = 4.0  # waiting requests per replica above which we scale up
    ttft_slo_s: float = 1.0  # TTFT p90 above which we scale up
    warm_spares: int = 0  # loaded replicas kept beyond demand
    scale_up_delay_s: float = 2.0  # pressure must hold this long before a normal scale-up...
    panic_threshold: float = 2.0  # ...unless pressure >= this: scale up at once
    max_scale_up_factor: float = 4.0  # one decision needs at most this times the reporting replicas
    scale_down_delay_s: float = 30.0  # calm must hold this long before one replica goes
    low_water: float = 0.5  # calm: every pressure below this
    kv_high: float = 0.95  # KV usage above this, with requests waiting, is pressure too
    down_seat_utilization: float = 0.75  # after a step down, running requests fill at most this of the seats

    def __post_init__(self) -> None:
        for name, low in (("min_replicas", 0), ("max_replicas", 1), ("warm_spares", 0)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        for name, test, wanted in _CHECKS:
            value = getattr(self, name)
            if not is_number(value) or not test(value):
                raise ValueError(f"{name} must be a number {wanted}, got {value!r}")


@dataclass(slots=True, frozen=True)
class AutoscalerState:
    # Replicas the load needs, spares not included; None: not yet known.
    demand: int | None = None
    # Since when pressure has been > 1 continuously.
    pressure_since_s: float | None = None
    # Since when every pressure has been under low_water continuously.
    calm_since_s: float | None = None
    last_scale_up_s: float | None = None


@dataclass(slots=True, frozen=True)
class Decision:
    num_replicas: int
    state: AutoscalerState
    # The largest pressure this call; 0.0 when no replica reports.
    pressure: float
    # Short human text: "up: 6.0 waiting/replica over target 4", "down: calm for 30 s", "hold...".
    reason: str


def decide(loads: Sequence[ReplicaLoad], target_replicas: int, now_s: float, config: AutoscalerConfig,
           state: AutoscalerState = AutoscalerState()) -> Decision:
    """The replica count to ask for now, and the state to pass to the next call. `loads` are the
    replicas running and reporting; `target_replicas` is the count asked for so far, which exceeds
    len(loads) while new replicas load weights."""
    known = state.demand if state.demand is not None else target_replicas - config.warm_spares
    demand = _clamp(known, config.min_replicas, config.max_replicas)
    if not loads:
        held = _clamp(target_replicas, config.min_replicas, config.max_replicas)
        return Decision(held, AutoscalerState(demand, None, None, state.last_scale_up_s), 0.0,
                        "hold: no replica reporting")
    pressures = _pressures(loads, config)
    occupied = _occupied(loads, 1.0) if config.warm_spares else 0
    if occupied > demand:  # the spares are taking load: demand has grown before any queue shows it
        pressures["spares"] = occupied / max(demand, 1)
    pressure = max(pressures.values())
    if pressure > 1:
        demand, state, reason = _scale_up(loads, target_replicas, now_s, config, state, demand, pressures, occupied)
    elif pressure < config.low_water:
        floor = _occupied(loads, config.down_seat_utilization)
        demand, state, reason = _scale_down(loads, now_s, config, state, demand, floor)
    else:
        state, reason = AutoscalerState(demand, None, None, state.last_scale_up_s), "hold"
    num_replicas = _clamp(demand + config.warm_spares, config.min_replicas, config.max_replicas)
    return Decision(num_replicas, state, pressure, reason)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


def _pressures(loads: Sequence[ReplicaLoad], config: AutoscalerConfig) -> dict[str, float]:
    num = len(loads)
    waiting_per_replica = sum(r.num_waiting_first_token for r in loads) / num
    ttft_s = sum(max(r.ttft_p90_s or 0.0, r.oldest_wait_s) for r in loads) / num
    kv = max(r.kv_usage / config.kv_high if r.num_waiting_first_token > 0 else min(r.kv_usage / config.kv_high, 1.0)
             for r in loads)
    return {"queue": waiting_per_replica / config.target_queue_per_replica,
            "ttft": ttft_s / config.ttft_slo_s, "kv": kv}


def _scale_up(loads: Sequence[ReplicaLoad], target_replicas: int, now_s: float, config: AutoscalerConfig,
              state: AutoscalerState, demand: int, pressures: dict[str, float],
              occupied: int) -> tuple[int, AutoscalerState, str]:
    pressure = max(pressures.values())
    since_s = now_s if state.pressure_since_s is None else state.pressure_since_s
    load_pressure = max(v for k, v in pressures.items() if k != "spares")
    # Spares taking load is never a panic: a burst that fills them for a moment is what they are
    # for; only load that keeps them busy for scale_up_delay_s is new demand.
    panic = load_pressure >= config.panic_threshold
    if not panic and now_s - since_s < config.scale_up_delay_s:
        waiting = AutoscalerState(demand, since_s, None, state.last_scale_up_s)
        return demand, waiting, f"hold: pressure {pressure:.2f} for {now_s - since_s:.1f} s"
    proportional = _proportional_need(loads, load_pressure) if load_pressure > 1 else 0
    needed = max(min(max(proportional, _seat_need(loads)),
                     math.ceil(len(loads) * config.max_scale_up_factor - _CEIL_SLACK)), occupied)
    if needed + config.warm_spares <= target_replicas:
        loading = AutoscalerState(demand, now_s, None, state.last_scale_up_s)
        return demand, loading, f"hold: {target_replicas - len(loads)} asked-for replicas still loading"
    new_demand = min(max(demand + 1, needed), config.max_replicas)
    if new_demand == demand:
        return demand, AutoscalerState(demand, since_s, None, state.last_scale_up_s), "hold: at max_replicas"
    verb = "panic" if panic else "up"
    return new_demand, AutoscalerState(new_demand, None, None, now_s), f"{verb}: {_why(pressures, config)}"


def _proportional_need(loads: Sequence[ReplicaLoad], pressure: float) -> int:
    return math.ceil(len(loads) * pressure - _CEIL_SLACK)


def _occupied(loads: Sequence[ReplicaLoad], utilization: float) -> int:
    """Replicas that seat the running requests with `utilization` of each one's seats (the reported
    max_num_seqs) taken; 0 when no replica reports its seats."""
    seats = [r.num_seats for r in loads if r.num_seats > 0]
    if not seats:
        return 0
    return math.ceil(sum(r.num_running for r in loads) / (utilization * sum(seats) / len(seats)) - _CEIL_SLACK)


def _seat_need(loads: Sequence[ReplicaLoad]) -> int:
    """Replicas that would seat every request now running or waiting, at the running count of the
    replicas that have a queue (a replica with requests waiting runs as many as it can hold). 0
    when no replica has a queue: then nothing says what a replica holds."""
    full = [r.num_running for r in loads if r.num_waiting_first_token > 0 and r.num_running > 0]
    if not full:
        return 0
    seats = sum(full) / len(full)
    return math.ceil(sum(r.num_running + r.num_waiting_first_token for r in loads) / seats - _CEIL_SLACK)


def _why(pressures: dict[str, float], config: AutoscalerConfig) -> str:
    name = max(pressures, key=pressures.__getitem__)
    if name == "queue":
        per_replica = pressures["queue"] * config.target_queue_per_replica
        return f"{per_replica:.1f} waiting/replica over target {config.target_queue_per_replica:g}"
    if name == "ttft":
        return f"ttft {pressures['ttft'] * config.ttft_slo_s:.2f} s over slo {config.ttft_slo_s:g} s"
    if name == "spares":
        return f"spares in use: running requests fill {pressures['spares']:.1f}x the demand's seats"
    return f"kv {pressures['kv'] * config.kv_high:.0%} full with requests waiting"


def _scale_down(loads: Sequence[ReplicaLoad], now_s: float, config: AutoscalerConfig, state: AutoscalerState,
                demand: int, floor: int) -> tuple[int, AutoscalerState, str]:
    since_s = now_s if state.calm_since_s is None else state.calm_since_s
    calm_s = now_s - since_s
    # Implied by the calm clock (a scale-up needs pressure > 1, which restarts it), but kept so that
    # a restored or hand-made state cannot scale down right after a scale-up.
    after_up_s = math.inf if state.last_scale_up_s is None else now_s - state.last_scale_up_s
    if min(calm_s, after_up_s) < config.scale_down_delay_s or demand <= config.min_replicas:
        return demand, AutoscalerState(demand, None, since_s, state.last_scale_up_s), f"hold: calm for {calm_s:.0f} s"
    # Idle: nothing waits or runs, and no first token came in the replicas' TTFT window either, so
    # this is not a momentary gap between requests (at 1x load two replicas are often both empty).
    idle = all(r.num_waiting_first_token == 0 and r.num_running == 0 and r.ttft_p90_s is None for r in loads)
    # Never below the replicas that seat what runs now within down_seat_utilization: a queue shows
    # only once a replica is full, so "calm" alone would remove capacity the load still uses.
    new_demand = config.min_replicas if idle else min(demand, max(demand - 1, floor, config.min_replicas))
    if new_demand == demand:
        return demand, AutoscalerState(demand, None, since_s, state.last_scale_up_s), "hold: the seats are busy"
    reason = "idle: to min" if idle else f"down: calm for {calm_s:.0f} s"
    return new_demand, AutoscalerState(new_demand, None, now_s, state.last_scale_up_s), reason


def to_dict(state: AutoscalerState) -> dict[str, int | float | None]:
    """JSON-safe, for Ray Serve's policy state."""
    return {f.name: getattr(state, f.name) for f in fields(AutoscalerState)}


def state_from_dict(d: object) -> AutoscalerState:
    """The state in `d`, ignoring keys that are not ours (Serve keeps its own in the same dict).
    A missing dict, or one with any bad value of ours, gives the default state: a partly trusted
    state could pair a demand with timers it never had, and the default just re-reads the target."""
    if not isinstance(d, Mapping):
        return AutoscalerState()
    values = {f.name: d.get(f.name) for f in fields(AutoscalerState)}
    demand = values.pop("demand")
    if demand is not None and (not is_int(demand) or demand < 0):
        return AutoscalerState()
    for name, value in values.items():
        if value is not None and (not is_number(value) or not math.isfinite(value)):
            return AutoscalerState()
    times = {name: None if value is None else float(value) for name, value in values.items()}
    return AutoscalerState(demand, **times)
