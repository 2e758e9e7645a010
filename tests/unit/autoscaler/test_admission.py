"""Ingress admission control with a fake clock: the sojourn-time prediction (oldest waiting age and
recent TTFT), shedding batch first, the hard limit, the recent window, and counts that stay right
whatever order tickets close in."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest

from autoscaler.admission import _MAX_RECENT_FIRST_TOKENS, AdmissionController, AdmissionPolicy, Ticket
from contracts.priority import PRIORITIES, Priority
from tests.unit.fakes import FakeClock

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def make(clock: FakeClock, **policy) -> AdmissionController:
    return AdmissionController(AdmissionPolicy(**policy), clock)


def serve_steadily(ctl: AdmissionController, clock: FakeClock, rate_per_s: float, duration_s: float,
                   ttft_s: float) -> None:
    """One request at a time at a steady arrival rate: admit, first token ttft_s later, done. Ends
    1 / rate_per_s - ttft_s after the last first token."""
    assert ttft_s < 1.0 / rate_per_s
    for _ in range(round(duration_s * rate_per_s)):
        verdict, ticket = ctl.admit(INTERACTIVE)
        assert verdict.admitted
        clock.advance(ttft_s)
        ticket.first_token()
        ticket.done()
        clock.advance(1.0 / rate_per_s - ttft_s)


def admit_ok(ctl: AdmissionController, priority: Priority = INTERACTIVE) -> Ticket:
    verdict, ticket = ctl.admit(priority)
    assert verdict.admitted and verdict.retry_after_s is None and ticket is not None, verdict.reason
    return ticket


def surge(ctl: AdmissionController, clock: FakeClock, queue: deque[Ticket], duration_s: float) -> dict[str, list]:
    """Arrivals at 40/s, alternately batch and interactive, while first tokens come at 10/s in order."""
    verdicts: dict[str, list] = {p: [] for p in PRIORITIES}
    for tick in range(1, round(duration_s * 40) + 1):
        clock.advance(0.025)
        if tick % 4 == 0:
            queue.popleft().first_token()
        priority = BATCH if tick % 2 else INTERACTIVE
        num_waiting = len(queue)
        verdict, ticket = ctl.admit(priority)
        verdicts[priority.label].append((num_waiting, verdict))
        if ticket is not None:
            queue.append(ticket)
    return verdicts


def test_steady_load_predicts_the_recent_ttft():
    clock = FakeClock()
    ctl = make(clock)
    serve_steadily(ctl, clock, rate_per_s=10, duration_s=10, ttft_s=0.03)
    snap = ctl.snapshot()
    # 20 first tokens in the 2 s window, each 0.03 s after its admission; nothing waiting.
    assert snap["first_token_rate_per_s"] == pytest.approx(10)
    assert snap["recent_ttft_s"] == pytest.approx(0.03) and snap["oldest_wait_s"] == 0.0
    assert ctl.predicted_wait_s() == pytest.approx(0.03)

    tickets = []
    for priority in (INTERACTIVE, BATCH, INTERACTIVE):
        tickets.append(admit_ok(ctl, priority))
        clock.advance(0.02)
    # The oldest has waited 0.06 s, longer than recent requests did: it sets the prediction.
    verdict, ticket = ctl.admit(BATCH)
    assert verdict.admitted and verdict.predicted_wait_s == pytest.approx(0.06)
    snap = ctl.snapshot()
    assert snap["num_waiting_first_token"] == 4 and snap["num_waiting_first_token_batch"] == 2 and snap["num_waiting_first_token_interactive"] == 2
    assert snap["oldest_wait_s"] == pytest.approx(0.06) and snap["recent_ttft_s"] == pytest.approx(0.03)
    assert snap["num_shed_batch"] == snap["num_shed_interactive"] == 0
    for t in [*tickets, ticket]:
        t.first_token()
        t.done()
    assert ctl.snapshot()["num_waiting_first_token"] == 0


def test_light_load_admits_batch_with_one_request_in_flight():
    clock = FakeClock()
    ctl = make(clock)
    # Arrivals at 0.2/s, each served in 0.1 s: 2% utilisation.
    serve_steadily(ctl, clock, rate_per_s=0.2, duration_s=30, ttft_s=0.1)
    in_flight = admit_ok(ctl)
    clock.advance(0.05)
    # Little's law on the count waiting now would say 1 / (0.2/s) = 5 s and shed this request;
    # the wait requests actually see is the in-flight one's 0.05 s.
    verdict, batch = ctl.admit(BATCH)
    assert verdict.admitted and verdict.predicted_wait_s == pytest.approx(0.05)
    snap = ctl.snapshot()
    assert snap["oldest_wait_s"] == pytest.approx(0.05) and snap["recent_ttft_s"] == 0.0

    clock.advance(0.05)
    in_flight.first_token()  # its 0.1 s TTFT is now the recent level, above the batch one's 0.05 s age
    verdict, other = ctl.admit(BATCH)
    assert verdict.admitted and verdict.predicted_wait_s == pytest.approx(0.1)
    for t in (in_flight, batch, other):
        t.done()
    assert ctl.snapshot()["num_waiting_first_token"] == 0


def test_a_growing_queue_sheds_batch_and_admits_interactive_up_to_the_hard_limit():
    clock = FakeClock()
    ctl = make(clock, max_waiting_requests=30)
    serve_steadily(ctl, clock, rate_per_s=10, duration_s=10, ttft_s=0.03)
    queue: deque[Ticket] = deque()
    verdicts = surge(ctl, clock, queue, duration_s=3.0)

    batch = [v for _, v in verdicts["batch"]]
    admitted = [v.admitted for v in batch]
    # Batch gets in while the queue is short, and is refused from then on as the waits only grow.
    assert admitted[0] and not admitted[-1] and admitted == sorted(admitted, reverse=True)
    for num_waiting, v in verdicts["batch"]:
        assert v.admitted == (v.predicted_wait_s <= 0.5 and num_waiting < 30)
        if not v.admitted:
            # Retry once the queue has turned over: the predicted wait, at least a second.
            assert v.retry_after_s == pytest.approx(max(v.predicted_wait_s, 1.0))
    shed = next(v for v in batch if not v.admitted)
    assert f"predicted wait {shed.predicted_wait_s:.2f} s > batch_max_wait_s=0.5 s" in shed.reason
    assert "oldest waiting" in shed.reason and "recent TTFT" in shed.reason

    # Interactive is refused only at the hard limit, never for the predicted wait.
    interactive = verdicts["interactive"]
    assert all(v.admitted == (n < 30) for n, v in interactive)
    refused = [v for _, v in interactive if not v.admitted]
    assert refused and "30 requests waiting" in refused[0].reason and "max_waiting_requests=30" in refused[0].reason
    assert any(v.admitted and v.predicted_wait_s > 1.0 for _, v in interactive)

    # Both terms rose past the batch limit: the queue's oldest and the TTFTs of those served.
    clock.advance(0.05)  # between first tokens, so the window holds exactly 20 of them
    snap = ctl.snapshot()
    assert snap["oldest_wait_s"] > 0.5 and snap["recent_ttft_s"] > 0.5
    assert snap["num_shed_batch"] == admitted.count(False) > 0 and snap["num_shed_interactive"] == len(refused)
    assert snap["first_token_rate_per_s"] == pytest.approx(10)
    for t in queue:
        t.done()
    assert ctl.snapshot()["num_waiting_first_token"] == 0


def test_batch_is_admitted_again_once_the_queue_drains_and_the_window_passes():
    clock = FakeClock()
    ctl = make(clock, max_waiting_requests=30)
    serve_steadily(ctl, clock, rate_per_s=10, duration_s=10, ttft_s=0.03)
    queue: deque[Ticket] = deque()
    surge(ctl, clock, queue, duration_s=3.0)
    assert not ctl.admit(BATCH)[0].admitted

    while queue:  # the replicas catch up: 20 first tokens/s, no arrivals
        clock.advance(0.05)
        queue.popleft().first_token()
    # Empty queue, but the requests just served waited seconds: batch stays shed for the window.
    snap = ctl.snapshot()
    assert snap["num_waiting_first_token"] == 0 and snap["oldest_wait_s"] == 0.0 and snap["recent_ttft_s"] > 0.5
    verdict, _ = ctl.admit(BATCH)
    assert not verdict.admitted and verdict.predicted_wait_s == pytest.approx(snap["recent_ttft_s"])

    clock.advance(2.01)  # the slow first tokens have left the recent window
    verdict, ticket = ctl.admit(BATCH)
    assert verdict.admitted and verdict.predicted_wait_s == 0.0
    ticket.first_token()
    snap = ctl.snapshot()
    assert snap["recent_ttft_s"] == 0.0 and snap["first_token_rate_per_s"] == pytest.approx(1 / 2.0)


def test_interactive_is_refused_only_at_the_hard_limit_and_readmitted_when_a_slot_frees():
    clock = FakeClock()
    ctl = make(clock, max_waiting_requests=4)
    tickets = [admit_ok(ctl) for _ in range(4)]
    clock.advance(60.0)  # stuck for a minute: no first token at all

    verdict, ticket = ctl.admit(INTERACTIVE)
    assert not verdict.admitted and ticket is None
    assert "4 requests waiting" in verdict.reason and "max_waiting_requests=4" in verdict.reason
    assert "oldest waiting 60.00 s" in verdict.reason
    # The oldest age (60 s) is the predicted wait; Retry-After is clamped to the maximum.
    assert verdict.predicted_wait_s == pytest.approx(60.0) and verdict.retry_after_s == 30.0
    assert not ctl.admit(BATCH)[0].admitted

    tickets[0].first_token()
    verdict, ticket = ctl.admit(INTERACTIVE)
    # Below the hard limit an interactive request gets in however long the predicted wait.
    assert verdict.admitted and verdict.predicted_wait_s == pytest.approx(60.0)
    assert not ctl.admit(INTERACTIVE)[0].admitted  # full again
    tickets[1].done()
    admit_ok(ctl)
    snap = ctl.snapshot()
    assert snap["num_shed_interactive"] == 2 and snap["num_shed_batch"] == 1 and snap["num_waiting_first_token"] == 4


def test_retry_after_is_the_predicted_wait_clamped():
    clock = FakeClock()
    ctl = make(clock, max_waiting_requests=2)
    slow = admit_ok(ctl)
    clock.advance(3.0)
    slow.first_token()  # recent TTFT 3 s
    waiting = [admit_ok(ctl), admit_ok(ctl)]
    clock.advance(0.2)
    verdict, _ = ctl.admit(INTERACTIVE)  # hard limit; the recent TTFT outweighs the 0.2 s age
    assert not verdict.admitted and verdict.predicted_wait_s == pytest.approx(3.0)
    assert verdict.retry_after_s == pytest.approx(3.0)
    verdict, _ = ctl.admit(BATCH)
    assert not verdict.admitted and verdict.retry_after_s == pytest.approx(3.0)

    clock.advance(2.5)  # the 3 s sample has left the window: the 2.7 s age remains
    waiting[0].done()
    verdict, _ = ctl.admit(BATCH)
    assert not verdict.admitted and verdict.retry_after_s == pytest.approx(2.7)
    waiting[1].done()

    short = admit_ok(ctl)
    clock.advance(0.6)
    admit_ok(ctl)
    verdict, _ = ctl.admit(INTERACTIVE)  # a short wait at the hard limit: the minimum applies
    assert not verdict.admitted and verdict.predicted_wait_s == pytest.approx(0.6) and verdict.retry_after_s == 1.0
    short.done()


def test_done_before_first_token_frees_the_slot_without_a_ttft_sample():
    clock = FakeClock()
    ctl = make(clock)
    cancelled = admit_ok(ctl, BATCH)
    clock.advance(1.0)
    cancelled.done()
    cancelled.first_token()  # after done(): ignored
    cancelled.done()
    snap = ctl.snapshot()
    assert snap["num_waiting_first_token"] == snap["num_waiting_first_token_batch"] == 0
    # Its 1 s wait is no TTFT: nothing waits and nothing was served, so no wait is predicted.
    assert snap["first_token_rate_per_s"] == 0.0 and snap["recent_ttft_s"] == 0.0 and snap["predicted_wait_s"] == 0.0

    served = admit_ok(ctl)
    clock.advance(0.2)
    served.first_token()
    served.first_token()
    served.done()
    served.done()
    with admit_ok(ctl) as scoped:  # leaving the block closes the ticket
        assert scoped.waiting
    assert not scoped.waiting
    snap = ctl.snapshot()
    assert snap["num_waiting_first_token"] == snap["num_waiting_first_token_interactive"] == 0
    assert snap["recent_ttft_s"] == pytest.approx(0.2)  # one sample: the served one
    assert snap["first_token_rate_per_s"] == pytest.approx(1 / 2.0)  # one first token in the 2 s window


def test_without_first_tokens_the_prediction_is_the_oldest_wait():
    clock = FakeClock()
    ctl = make(clock)
    assert ctl.predicted_wait_s() == 0.0
    oldest = admit_ok(ctl)
    clock.advance(3.0)
    assert ctl.predicted_wait_s() == pytest.approx(3.0)
    newer = admit_ok(ctl)
    clock.advance(1.0)
    assert ctl.predicted_wait_s() == pytest.approx(4.0)  # the oldest, not the newest
    oldest.done()
    assert ctl.predicted_wait_s() == pytest.approx(1.0)
    newer.done()
    assert ctl.predicted_wait_s() == 0.0


def test_recent_ttft_is_the_mean_over_the_window_and_forgets_old_samples():
    clock = FakeClock()
    ctl = make(clock, recent_window_s=2.0)
    a, b, c = admit_ok(ctl), admit_ok(ctl), admit_ok(ctl)
    clock.advance(0.1)
    a.first_token()
    clock.advance(0.1)
    b.first_token()
    clock.advance(0.4)
    c.first_token()
    snap = ctl.snapshot()
    assert snap["recent_ttft_s"] == pytest.approx((0.1 + 0.2 + 0.6) / 3) and snap["oldest_wait_s"] == 0.0
    assert snap["first_token_rate_per_s"] == pytest.approx(3 / 2.0)

    clock.advance(1.85)  # a's and b's first tokens are over 2 s old, c's is 1.85 s old
    assert ctl.snapshot()["recent_ttft_s"] == pytest.approx(0.6)
    assert ctl.predicted_wait_s() == pytest.approx(0.6)
    clock.advance(0.3)  # all gone
    snap = ctl.snapshot()
    assert snap["recent_ttft_s"] == 0.0 and snap["first_token_rate_per_s"] == 0.0 and snap["predicted_wait_s"] == 0.0


def test_memory_stays_bounded_at_a_high_rate_and_the_rate_stays_right():
    clock = FakeClock()
    ctl = make(clock)
    # 5000 first tokens/s: 10000 in a 2 s window, more than the samples kept.
    serve_steadily(ctl, clock, rate_per_s=5000, duration_s=3, ttft_s=1e-4)
    assert len(ctl._recent) == _MAX_RECENT_FIRST_TOKENS
    snap = ctl.snapshot()
    assert snap["first_token_rate_per_s"] == pytest.approx(5000, rel=0.01)
    assert snap["recent_ttft_s"] == pytest.approx(1e-4)


@pytest.mark.parametrize("field, value", [
    ("max_waiting_requests", 0), ("max_waiting_requests", 2.5), ("max_waiting_requests", True),
    ("batch_max_wait_s", -0.1), ("batch_max_wait_s", math.nan), ("recent_window_s", 0.0),
    ("recent_window_s", math.inf), ("min_retry_after_s", 0.0), ("max_retry_after_s", 0.5),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AdmissionPolicy(**{field: value})


@pytest.mark.parametrize("priority", ["urgent", "", "Batch"])
def test_unknown_priority_is_refused_with_value_error(priority):
    ctl = make(FakeClock())
    with pytest.raises(ValueError, match="priority"):
        ctl.admit(priority)
    assert ctl.snapshot()["num_waiting_first_token"] == 0


def test_random_sequences_keep_the_counts_and_the_prediction_right():
    rng = random.Random(1234)
    clock = FakeClock()
    ctl = make(clock, max_waiting_requests=8)
    states: dict[Ticket, str] = {}  # the model: "waiting", "started" or "done"
    first_tokens: list[tuple[float, float]] = []  # the model: (first token time, TTFT)
    attempts = dict.fromkeys(PRIORITIES, 0)
    for _ in range(3000):
        clock.advance(rng.expovariate(20.0))
        op = rng.random()
        if op < 0.45:
            priority = rng.choice(list(Priority))
            attempts[priority.label] += 1
            num_waiting = sum(1 for s in states.values() if s == "waiting")
            verdict, ticket = ctl.admit(priority)
            assert (ticket is not None) == verdict.admitted and verdict.predicted_wait_s >= 0
            if ticket is None:
                assert verdict.retry_after_s == pytest.approx(min(max(verdict.predicted_wait_s, 1.0), 30.0))
                # Interactive traffic meets only the hard limit; batch also the predicted wait.
                assert num_waiting == 8 or (priority is BATCH and verdict.predicted_wait_s > 0.5)
            else:
                assert num_waiting < 8
                states[ticket] = "waiting"
        elif states:
            # Mostly open tickets, so the queue moves; sometimes closed ones: repeats must be harmless.
            open_tickets = [t for t, s in states.items() if s != "done"]
            ticket = rng.choice(open_tickets if open_tickets and rng.random() < 0.85 else list(states))
            if op < 0.75:
                if states[ticket] == "waiting":
                    first_tokens.append((clock(), clock() - ticket.admitted_s))
                ticket.first_token()
                states[ticket] = "started" if states[ticket] == "waiting" else states[ticket]
            else:
                ticket.done()
                states[ticket] = "done"
        snap = ctl.snapshot()
        for p in PRIORITIES:
            expected = sum(1 for t, s in states.items() if s == "waiting" and t.priority.label == p)
            assert snap[f"num_waiting_first_token_{p}"] == expected
            assert snap[f"num_admitted_{p}"] + snap[f"num_shed_{p}"] == attempts[p]
        assert snap["num_waiting_first_token"] == snap["num_waiting_first_token_interactive"] + snap["num_waiting_first_token_batch"]
        recent = [ttft for t, ttft in first_tokens if t >= clock() - 2.0]
        admitted_s = [t.admitted_s for t, s in states.items() if s == "waiting"]
        assert snap["recent_ttft_s"] == pytest.approx(sum(recent) / len(recent) if recent else 0.0)
        assert snap["first_token_rate_per_s"] == pytest.approx(len(recent) / 2.0)
        assert snap["oldest_wait_s"] == pytest.approx(clock() - min(admitted_s) if admitted_s else 0.0)
        assert snap["predicted_wait_s"] == max(snap["oldest_wait_s"], snap["recent_ttft_s"])
    # Every path was exercised: admissions, batch shedding and the hard limit.
    assert len(states) > 300 and snap["num_shed_batch"] > 0 and snap["num_shed_interactive"] > 0
    for ticket in states:
        ticket.done()
    assert ctl.snapshot()["num_waiting_first_token"] == 0
