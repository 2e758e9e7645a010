"""Fault isolation for one step: when the runner raises, find the requests that cause it. Pure.

A step batches many requests, and an exception from the runner says nothing about which of them
caused it. Failing the whole batch lets one bad request take down every request beside it, and
letting the exception kill the engine takes down the replica. So a failed step is retried in
parts, as a bisection over the batch's sequences (left half first, so a sequence that fills a
block another one hits in the same step is still written first):

- A probe (a one-token forward that no request owns) runs first. If it fails too, the runner
  itself is broken: no request is blamed, and the caller requeues them all and counts the
  failure (the engine gives up after a few in a row, and the replica is replaced).
- Otherwise every sub-batch that runs returns its tokens; a single sequence that still fails on
  its own is a culprit. Culprits fail with the error they raised; the rest of the step stands.

Re-running a sub-batch writes the same K/V slots again, so survivors end the step exactly as if
it had not failed; only unseeded random draws differ (the generator advanced). Costs nothing
unless a step fails; then about 2 log2(N) forwards per culprit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from model_worker.sched.batch import ScheduledSequence, SchedulerOutput


@dataclass(slots=True)
class IsolatedStep:
    # The sequences that ran, in batch order, and their sampled tokens (one per sample=True).
    batch: SchedulerOutput
    sampled: list[int]
    # Sequences that failed on their own, with the error each raised.
    culprits: list[tuple[ScheduledSequence, BaseException]] = field(default_factory=list)
    # Set when the runner failed with no request to blame (the probe failed too): nothing ran.
    runner_error: BaseException | None = None


def execute_isolating(execute: Callable[[SchedulerOutput], list[int]], batch: SchedulerOutput,
                      probe: Callable[[], BaseException | None]) -> IsolatedStep:
    """Run the batch; if it raises, find the culprits (see the module docstring)."""
    try:
        return IsolatedStep(batch, execute(batch))
    except Exception as first_error:
        probe_error = probe()
        if probe_error is not None:
            return IsolatedStep(SchedulerOutput(), [], runner_error=first_error)
    survivors: list[tuple[ScheduledSequence, list[int]]] = []
    culprits: list[tuple[ScheduledSequence, BaseException]] = []
    _bisect(execute, batch.sequences, survivors, culprits)
    sequences = [seq for seq, _ in survivors]
    sampled = [token for _, tokens in survivors for token in tokens]
    return IsolatedStep(_sub_batch(sequences), sampled, culprits)


def _bisect(execute: Callable[[SchedulerOutput], list[int]], sequences: list[ScheduledSequence],
            survivors: list[tuple[ScheduledSequence, list[int]]],
            culprits: list[tuple[ScheduledSequence, BaseException]]) -> None:
    """`sequences` failed together: run each half, and split again the halves that fail."""
    if len(sequences) == 1:  # the whole step was this one sequence: it gets one more try alone
        _run_alone(execute, sequences[0], survivors, culprits)
        return
    middle = len(sequences) // 2
    for half in (sequences[:middle], sequences[middle:]):
        if len(half) == 1:
            _run_alone(execute, half[0], survivors, culprits)
            continue
        try:
            tokens = execute(_sub_batch(half))
        except Exception:
            _bisect(execute, half, survivors, culprits)
        else:
            _split_tokens(half, tokens, survivors)


def _run_alone(execute: Callable[[SchedulerOutput], list[int]], seq: ScheduledSequence,
               survivors: list[tuple[ScheduledSequence, list[int]]],
               culprits: list[tuple[ScheduledSequence, BaseException]]) -> None:
    try:
        tokens = execute(_sub_batch([seq]))
    except Exception as exc:
        culprits.append((seq, exc))
    else:
        _split_tokens([seq], tokens, survivors)


def _split_tokens(sequences: list[ScheduledSequence], tokens: list[int],
                  survivors: list[tuple[ScheduledSequence, list[int]]]) -> None:
    it = iter(tokens)
    for seq in sequences:
        survivors.append((seq, [next(it)] if seq.sample else []))


def _sub_batch(sequences: list[ScheduledSequence]) -> SchedulerOutput:
    return SchedulerOutput(sequences=sequences, num_scheduled_tokens=sum(len(seq.token_ids) for seq in sequences))
