"""Admission control: a bounded queue that sheds batch traffic first. Pure (no torch, no Ray), the
clock passed in.

One module for both places that admit work. The ingress calls `admit(priority)` before it sends a
generation request to an engine replica; each LLMServer replica calls it again before its engine
takes the request (the backstop behind the ingress, for callers that reach a replica through a
handle). The queue each guards is its own requests that were admitted but have no first token yet:
their wait is what users feel as TTFT, and it is what grows when the replicas fall behind. The
replica reads the same queue for the autoscaler (`queue_stats`: its size, oldest age and windowed
TTFT p90).

Prediction (sojourn time, the idea behind CoDel): a new arrival should expect the wait that requests
are experiencing now,

    predicted_wait_s = max(oldest waiting request's age, recent TTFT)

with recent TTFT the mean admit-to-first-token time of the requests whose first token came in the
last recent_window_s. The recent-TTFT term carries the current level while requests are served; the
oldest-age term sees a queue that grows before any of its requests gets a first token (a burst, a
stalled replica), which the TTFT of requests already served cannot. Empty queue and no recent first
token: 0. A request that ends without a first token (cancelled, failed) adds no TTFT sample.

Why not Little's law on the count waiting now: N = r * W holds for the time-averaged N, and N / r
with the instantaneous N is wrong whenever the queue is small next to the rate. With one request in
flight and arrivals at 0.2/s, r = 0.2/s gives N / r = 5 s, so a batch request would be shed at 2%
utilisation while the real wait is the engine's TTFT, about 0.1 s. The sojourn time measures the wait
directly, at any load.

The mean, not a high percentile: over a 2 s window at modest rates a p90 is the maximum of a handful
of samples, so one long prefill would shed batch for the whole window; the mean is what the average
arrival waits, and the tail that matters (a queue standing behind a stuck request) is what the
oldest-age term catches. Known bias: a TTFT includes the request's own prefill, so a very long
prompt reads as queueing for as long as it prefills plus one window; the error is toward shedding
batch, which retries cheaply.

Rules: at max_waiting_requests any request is refused (the hard limit); a batch request is refused
once the predicted wait passes batch_max_wait_s, or once batch_shed_fraction of the hard limit is
waiting, so batch traffic is shed long before interactive traffic feels the queue. The ingress sheds
by predicted wait; a replica (`replica_policy`) by count alone, with a fixed Retry-After. Retry-After, for either refusal, is the predicted wait clamped to
[min_retry_after_s, max_retry_after_s]: in about that time every request waiting now has had its
first token, so the queue the client was refused from has turned over. Simple on purpose: a client
that comes back too early gets another cheap 429, one that stays away too long is clamped.

Not thread-safe: one controller per ingress event loop.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from contracts.checks import is_int, is_number
from contracts.priority import Priority
from model_worker.engine.stats import percentile

# The most TTFT samples kept, so memory stays bounded (~300 KB) at any rate. Beyond 2048 first
# tokens/s in the default 2 s window the oldest samples go early: the mean is then over the newest
# 4096, all still inside the window, and the rate is taken over the span they cover.
_MAX_RECENT_FIRST_TOKENS = 4096
# Floor of the span a full sample deque covers, so a clock that did not move gives no infinite rate.
_MIN_RATE_SPAN_S = 1e-6
# A replica's TTFT p90 for the autoscaler covers first tokens of the last this many seconds: short
# enough that a surge shows within seconds, long enough to hold a few dozen samples at a few
# requests per second.
REPLICA_TTFT_WINDOW_S = 5.0


@dataclass(slots=True, frozen=True)
class AdmissionPolicy:
    # Requests waiting for a first token at this ingress at which every request is refused, and the
    # only limit interactive traffic meets. 512 is four full batches at the engine's default
    # max_num_seqs of 128: past that a new request waits longer than a retry elsewhere costs.
    max_waiting_requests: int = 512
    # Batch traffic tolerates latency, but it must not build the queue interactive users sit in:
    # past half a second of predicted wait, shedding batch keeps interactive TTFT near the engine's.
    batch_max_wait_s: float = 0.5
    # TTFT samples older than this leave the prediction. Short, so the signal follows a surge within
    # seconds and stops shedding within seconds of it clearing (a mean over 10 s would dilute a new
    # surge with calm samples, then hold it for 10 s after); longer than a normal TTFT, so moderate
    # load keeps samples in it. At light load it may hold none: then the oldest age is the signal.
    recent_window_s: float = 2.0
    # Retry-After goes out in whole seconds (RFC 9110); below one second clients retry in a storm.
    min_retry_after_s: float = 1.0
    # Beyond this the estimate is stale by the time the client comes back.
    max_retry_after_s: float = 30.0
    # An admitted request still without a first token after this long is given up (503 with
    # Retry-After) rather than left waiting with no answer: a client's own timeout is usually about
    # a minute, and by then the capacity it waited for went to requests that came later anyway.
    # Batch traffic, shed first, gets half of it.
    queue_timeout_s: float = 60.0
    batch_queue_timeout_s: float = 30.0
    # Batch requests are also refused once this fraction of max_waiting_requests is waiting, so that
    # interactive traffic keeps the rest of the queue (1.0: only the hard limit counts for batch).
    batch_shed_fraction: float = 1.0

    def __post_init__(self) -> None:
        if (not is_int(self.max_waiting_requests)
                or self.max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be an integer >= 1, got {self.max_waiting_requests!r}")
        # math.inf turns shedding by predicted wait off (a replica sheds by count alone).
        if not (is_number(self.batch_max_wait_s) and self.batch_max_wait_s >= 0):
            raise ValueError(f"batch_max_wait_s must be >= 0, got {self.batch_max_wait_s!r}")
        if not (is_number(self.batch_shed_fraction) and 0.0 < self.batch_shed_fraction <= 1.0):
            raise ValueError(f"batch_shed_fraction must be in (0, 1], got {self.batch_shed_fraction!r}")
        for name in ("recent_window_s", "min_retry_after_s", "queue_timeout_s", "batch_queue_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if not (math.isfinite(self.max_retry_after_s) and self.max_retry_after_s >= self.min_retry_after_s):
            raise ValueError(f"max_retry_after_s must be finite and >= min_retry_after_s "
                             f"({self.min_retry_after_s!r}), got {self.max_retry_after_s!r}")

    def queue_timeout_for(self, priority: Priority) -> float:
        return self.batch_queue_timeout_s if priority is Priority.BATCH else self.queue_timeout_s

    def limit(self, priority: Priority) -> int:
        """Requests waiting at which one more of this priority is refused."""
        if priority is Priority.BATCH:
            return max(1, int(self.max_waiting_requests * self.batch_shed_fraction))
        return self.max_waiting_requests


def replica_policy(max_waiting_requests: int = 256, batch_shed_fraction: float = 0.5, retry_after_s: float = 1.0,
                   ttft_window_s: float = REPLICA_TTFT_WINDOW_S) -> AdmissionPolicy:
    """An LLMServer replica's policy (the `admission` app arg): shed by count alone, with a fixed
    Retry-After. 256 waiting is about two full batches at the default max_num_seqs of 128: past that
    a new request would wait longer than it takes a client to retry elsewhere; batch requests are
    refused from batch_shed_fraction of it on. ttft_window_s is the window of the TTFT p90 the
    autoscaler reads."""
    if not (is_number(retry_after_s) and math.isfinite(retry_after_s) and retry_after_s > 0):
        raise ValueError(f"retry_after_s must be finite and > 0, got {retry_after_s!r}")
    return AdmissionPolicy(max_waiting_requests=max_waiting_requests, batch_shed_fraction=batch_shed_fraction,
                           batch_max_wait_s=math.inf, recent_window_s=ttft_window_s,
                           min_retry_after_s=retry_after_s, max_retry_after_s=retry_after_s)


@dataclass(slots=True, frozen=True)
class Verdict:
    admitted: bool
    # Seconds the client should wait before retrying; None when admitted.
    retry_after_s: float | None
    # The wait predicted for this request when it arrived.
    predicted_wait_s: float
    # Which limit refused it, with the numbers; goes into the 429 message.
    reason: str


class Ticket:
    """One admitted request. Call first_token() when its first token arrives and done() when it
    ends for any reason (leaving a `with ticket:` block calls done()). Both are idempotent and safe
    in any order: a first token after done() is ignored."""

    __slots__ = ("priority", "admitted_s", "_controller", "_waiting", "_done")

    def __init__(self, controller: AdmissionController, priority: Priority, admitted_s: float) -> None:
        self.priority = priority
        self.admitted_s = admitted_s
        self._controller = controller
        self._waiting = True
        self._done = False

    @property
    def waiting(self) -> bool:
        """True until the first token or done(), whichever comes first."""
        return self._waiting

    def first_token(self, sample: bool = True) -> None:
        """sample=False: the first token is no time to first token (a request resumed on another
        replica after some output); it leaves the queue but adds no TTFT sample."""
        if self._waiting:
            self._controller._leave(self, got_first_token=sample)

    def done(self) -> None:
        if self._done:
            return
        self._done = True
        if self._waiting:
            # Cancelled or failed before a first token: it frees its slot but is no TTFT sample.
            self._controller._leave(self, got_first_token=False)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done()


class _RecentFirstTokens:
    """(first token time, TTFT) of the first tokens in the last window_s, oldest first, with the
    running sum of their TTFTs. Pruned by time on every call and capped at _MAX_RECENT_FIRST_TOKENS
    entries, so memory is bounded at any rate."""

    __slots__ = ("window_s", "_samples", "_ttft_sum_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()
        self._ttft_sum_s = 0.0

    def add(self, now_s: float, ttft_s: float) -> None:
        self.prune(now_s)
        if len(self._samples) >= _MAX_RECENT_FIRST_TOKENS:
            self._ttft_sum_s -= self._samples.popleft()[1]
        self._samples.append((now_s, ttft_s))
        self._ttft_sum_s += ttft_s

    def prune(self, now_s: float) -> None:
        # From the left only: after a clock step back a sample may leave late, never early.
        oldest_kept_s = now_s - self.window_s
        while self._samples and self._samples[0][0] < oldest_kept_s:
            self._ttft_sum_s -= self._samples.popleft()[1]
        if not self._samples:
            self._ttft_sum_s = 0.0  # no float drift survives an empty window

    def ttft_percentile_s(self, now_s: float, q: float) -> float | None:
        self.prune(now_s)
        return percentile([ttft for _, ttft in self._samples], q)

    def mean_ttft_s(self, now_s: float) -> float:
        self.prune(now_s)
        return max(self._ttft_sum_s / len(self._samples), 0.0) if self._samples else 0.0

    def rate_per_s(self, now_s: float) -> float:
        """First tokens per second over the window (so below the true rate in the first window of
        the controller's life); over the span kept once the cap, not the window, bounds the samples."""
        self.prune(now_s)
        count = len(self._samples)
        if count < _MAX_RECENT_FIRST_TOKENS:
            return count / self.window_s
        return count / max(now_s - self._samples[0][0], _MIN_RATE_SPAN_S)

    def __len__(self) -> int:
        return len(self._samples)


class AdmissionController:
    def __init__(self, policy: AdmissionPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self._clock = clock
        self._recent = _RecentFirstTokens(policy.recent_window_s)
        # Waiting tickets in admission order, so the first is the oldest (O(1) with OrderedDict).
        self._waiting: OrderedDict[Ticket, None] = OrderedDict()
        self._num_waiting = dict.fromkeys(Priority, 0)
        self._num_admitted = dict.fromkeys(Priority, 0)
        self._num_shed = dict.fromkeys(Priority, 0)
        self._num_timed_out = dict.fromkeys(Priority, 0)

    def admit(self, priority: Priority) -> tuple[Verdict, Ticket | None]:
        """Admit or refuse one request. An admitted one gets a Ticket the caller must close."""
        if not isinstance(priority, Priority):  # parsed once, where the request came in
            raise ValueError(f"priority must be a Priority, got {priority!r}")
        now = self._clock()
        oldest_s, recent_ttft_s = self._oldest_wait_s(now), self._recent.mean_ttft_s(now)
        wait_s = max(oldest_s, recent_ttft_s)
        reason = self._refusal(priority, wait_s, oldest_s, recent_ttft_s)
        if reason is not None:
            self._num_shed[priority] += 1
            retry_s = min(max(wait_s, self.policy.min_retry_after_s), self.policy.max_retry_after_s)
            return Verdict(False, retry_s, wait_s, reason), None
        ticket = Ticket(self, priority, now)
        self._waiting[ticket] = None
        self._num_waiting[priority] += 1
        self._num_admitted[priority] += 1
        return Verdict(True, None, wait_s, "admitted"), ticket

    def predicted_wait_s(self) -> float:
        now = self._clock()
        return max(self._oldest_wait_s(now), self._recent.mean_ttft_s(now))

    def snapshot(self) -> dict[str, float]:
        now = self._clock()
        oldest_s, recent_ttft_s = self._oldest_wait_s(now), self._recent.mean_ttft_s(now)
        stats: dict[str, float] = {
            "num_waiting_first_token": len(self._waiting), "predicted_wait_s": max(oldest_s, recent_ttft_s),
            "oldest_wait_s": oldest_s, "recent_ttft_s": recent_ttft_s,
            "first_token_rate_per_s": self._recent.rate_per_s(now)}
        for p in Priority:
            stats[f"num_waiting_first_token_{p.label}"] = self._num_waiting[p]
            stats[f"num_admitted_{p.label}"] = self._num_admitted[p]
            stats[f"num_shed_{p.label}"] = self._num_shed[p]
            stats[f"num_timed_out_{p.label}"] = self._num_timed_out[p]
        return stats

    def queue_stats(self) -> dict[str, float]:
        """What the autoscaler reads: requests waiting, the oldest one's age, and the TTFT p90 over
        the recent window (absent when no first token came in it)."""
        now = self._clock()
        stats = {"num_waiting_first_token": float(len(self._waiting)), "oldest_wait_s": self._oldest_wait_s(now)}
        p90 = self._recent.ttft_percentile_s(now, 90)  # sorts the window: for the autoscaler's poll only
        if p90 is not None:
            stats["ttft_p90_s"] = p90
        return stats

    def oldest_wait_s(self) -> float:
        """Age of the oldest request still waiting for its first token; 0 with none waiting."""
        return self._oldest_wait_s(self._clock())

    def num_waiting(self, priority: Priority) -> int:
        """Admitted requests of this priority without a first token yet."""
        return self._num_waiting[priority]

    def num_shed(self, priority: Priority) -> int:
        return self._num_shed[priority]

    def num_timed_out(self, priority: Priority) -> int:
        return self._num_timed_out[priority]

    def timed_out(self, ticket: Ticket) -> None:
        """The ticket's request waited past its queue timeout (counted; done() still ends it)."""
        self._num_timed_out[ticket.priority] += 1

    def _refusal(self, priority: Priority, wait_s: float, oldest_s: float, recent_ttft_s: float) -> str | None:
        """The reason, with the numbers, if refused."""
        p = self.policy
        n = len(self._waiting)
        terms = (f"oldest waiting {oldest_s:.2f} s, recent TTFT {recent_ttft_s:.2f} s over "
                 f"{len(self._recent)} first tokens in {p.recent_window_s:g} s")
        if n >= p.max_waiting_requests:
            return (f"{n} requests waiting for a first token, at the limit max_waiting_requests="
                    f"{p.max_waiting_requests}; predicted wait {wait_s:.2f} s ({terms})")
        if priority is Priority.BATCH and wait_s > p.batch_max_wait_s:
            return (f"batch request shed: predicted wait {wait_s:.2f} s > batch_max_wait_s="
                    f"{p.batch_max_wait_s:g} s ({n} waiting; {terms})")
        batch_limit = p.limit(Priority.BATCH)
        if priority is Priority.BATCH and n >= batch_limit:
            return (f"batch request shed: {n} requests waiting for a first token, at the batch limit "
                    f"{batch_limit} (batch_shed_fraction={p.batch_shed_fraction:g} of "
                    f"max_waiting_requests={p.max_waiting_requests})")
        return None

    def _oldest_wait_s(self, now: float) -> float:
        if not self._waiting:
            return 0.0
        oldest = next(iter(self._waiting))
        return max(now - oldest.admitted_s, 0.0)

    def _leave(self, ticket: Ticket, got_first_token: bool) -> None:
        del self._waiting[ticket]
        ticket._waiting = False
        self._num_waiting[ticket.priority] -= 1
        if got_first_token:
            now = self._clock()
            self._recent.add(now, max(now - ticket.admitted_s, 0.0))
