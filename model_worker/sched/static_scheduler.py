"""Static (request-level) batching: the baseline the benchmarks compare continuous batching with.

Waiting requests join only when the previous batch has entirely finished, and a finished request
is reported only then. As in a fixed-shape batch (transformers' generate, FasterTransformer), a
finished member keeps its slot and its KV blocks until the batch ends and keeps costing one decode
per step: it recomputes its last token in place and the result is discarded. Everything else
(chunked prefill, prefix caching, preemption within the batch) is the continuous scheduler's.
"""

from __future__ import annotations

from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.sched.request import Request, RequestStatus
from model_worker.sched.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # Finished batch members, reported (and their blocks freed) when the batch ends.
        self._held: list[Request] = []
        # Held members that have a KV slot to keep decoding into.
        self._padding_ids: set[str] = set()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running and not self._held:
            self._admit_batch()
        # A fixed-shape batch's baseline: its prompts fill the token budget (no stall-free chunks).
        budget, _ = self._schedule_running(out, self.config.max_num_batched_tokens, self.config.max_num_batched_tokens)
        if self.running:
            budget = self._schedule_padding(out, budget)
        out.num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    def abort(self, request_id: str) -> bool:
        if super().abort(request_id):
            return True
        for held in self._held:
            if held.request_id == request_id:
                self._held.remove(held)
                self._padding_ids.discard(request_id)
                self.kv.free(held)
                held.status = RequestStatus.FINISHED_ABORTED
                return True
        return False

    def take_finished(self) -> list[Request]:
        if self._held and not self.running:  # the batch has ended: report and free every member
            for request in self._held:
                self.kv.free(request)
            self._finished.extend(self._held)
            self._held.clear()
            self._padding_ids.clear()
        return super().take_finished()

    def has_unfinished(self) -> bool:
        return bool(self._held) or super().has_unfinished()

    def _admit_batch(self) -> None:
        """Start a new request-level batch: everyone waiting, up to max_num_seqs, at once."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hits = self.kv.get_computed_blocks(request)
            if not self.kv.allocate_slots(request, 0, hits):
                break
            self.waiting.pop()
            self._start_running(request, len(hits) * self.config.block_size)

    def _schedule_padding(self, out: SchedulerOutput, budget: int) -> int:
        """Finished members still cost a decode each, as in a fixed-shape batch."""
        for request in self._held:
            if budget == 0:
                break
            if request.request_id not in self._padding_ids:
                continue
            out.sequences.append(ScheduledSequence(
                request_id=request.request_id,
                token_ids=[request.output_token_ids[-1]],
                start_position=request.num_computed_tokens,
                block_table=self.kv.block_ids(request.request_id),
                sample=True,
                sampling_params=request.sampling_params,
                output_index=request.num_output_tokens,
                history=((request.prompt_token_ids, request.output_token_ids)
                         if request.sampling_params.penalises_history else None),
            ))
            budget -= 1
        return budget

    def _release(self, request: Request, status: RequestStatus) -> None:
        """A finished member keeps its blocks, plus a slot for its last token so it can keep
        decoding in place (without a free block for that slot it just waits), until the batch ends."""
        if status == RequestStatus.FINISHED_ABORTED:
            super()._release(request, status)
            return
        self._held.append(request)
        if self.kv.allocate_slots(request, 1, cache_blocks=False):
            self._padding_ids.add(request.request_id)
