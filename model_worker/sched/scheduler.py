"""The iteration-level scheduler: decides the whole batch again before every step.

Each step: running requests first (highest priority, then earliest arrival), each computing what
it still lacks (one token when decoding, a chunk of prompt while prefilling), then waiting
requests in the same order while the token budget, max_num_seqs and free blocks allow. A request
that needs a block when none is free preempts the lowest-priority, latest-arrived running request
(possibly itself); the victim's full blocks stay in the prefix cache and it is recomputed later.
No new request is admitted in a step that preempted for blocks. When every seat (max_num_seqs) is
taken, a waiting request of a more urgent class (interactive over batch) takes the seat of the
least urgent running one.

How many of a step's tokens may be prompt tokens while requests decode is the StepBudget's call
(model_worker/sched/step_budget.py, stall-free batching, with max_decode_slowdown set): a chunk
the step can afford beside its decodes, from the step times this scheduler has seen. Decodes are
never left out for a prompt: a prefill ahead of them in the running order takes only the prompt
budget.

Static (request-level) batching, the benchmarks' baseline, is a policy of its own beside this
one: model_worker/sched/static_scheduler.py. `model_worker.sched.selector.make_scheduler` picks by
`SchedulerConfig.batching`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.config import SchedulerConfig
from model_worker.sched.kv_cache_manager import KVCacheManager
from model_worker.sched.request import Priority, Request, RequestStatus
from model_worker.sched.request_checks import RequestRejected, check_kv_capacity, check_request_id_unused
from model_worker.sched.request_queue import RequestQueue
from model_worker.sched.step_budget import StepBudget

__all__ = ["RequestRejected", "Scheduler"]


def _running_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self._block_tables = self.kv.block_tables
        self.waiting = RequestQueue()
        # Sorted by (priority, arrival): the preemption victim is always the last one.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished: list[Request] = []
        self._next_arrival_seq = 0
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.step_budget = StepBudget(config.max_num_batched_tokens, config.max_decode_slowdown,
                                      min_tokens=config.block_size)
        # The clock at the last schedule(), and its batch's decodes and prompt tokens: update()
        # tells the step budget what that step took.
        self._scheduled_s = 0.0
        self._scheduled_mix = (0, 0)

    # ---- submission and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._validate(request)
        request.arrival_seq = self._next_arrival_seq
        self._next_arrival_seq += 1
        request.status = RequestStatus.WAITING
        if self.config.enable_prefix_caching:
            request.update_block_hashes(self.config.block_size)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def _validate(self, request: Request) -> None:
        """The scheduler's own invariants: one request per id, and every request can fit the whole
        cache (one that cannot would wait, or preempt everything, forever). The rest (token ids,
        the context length, block hashes) was checked at the engine's door (RequestChecker) before
        the request was sent here, and is not scanned again."""
        check_request_id_unused(request.request_id, self.requests)
        check_kv_capacity(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.block_size,
                          self.config.num_kv_blocks)

    def abort(self, request_id: str) -> bool:
        """Drop a request from any state and free its blocks at once. It is not reported."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            return True
        return False

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish a live request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self._finish(request, status)

    def requeue(self, request_id: str) -> None:
        """A running request whose step did not count (the runner failed) goes back to the head of
        the queue and is recomputed, like a preempted one; its output tokens stay."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._preempt(request)

    def take_finished(self) -> list[Request]:
        """Requests whose end should be reported now."""
        finished, self._finished = self._finished, []
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        num_seats_freed = self._free_seats_for_urgent(out)
        num_decodes, num_prefilling = self._num_decoding_and_prefilling()
        prompt_budget = self.step_budget.prompt_tokens(num_decodes, num_prefilling + len(self.waiting))
        budget, prompt_budget = self._schedule_running(out, budget, prompt_budget)
        if len(out.preempted_request_ids) == num_seats_freed:
            budget = self._schedule_waiting(out, budget, prompt_budget)
        out.num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        self._scheduled_s = self.clock()
        num_decoded = sum(len(seq.token_ids) == 1 for seq in out.sequences)
        self._scheduled_mix = (num_decoded, out.num_scheduled_tokens - num_decoded)
        return out

    def _num_decoding_and_prefilling(self) -> tuple[int, int]:
        """Running requests that need one token (the decodes of the next step), and the others."""
        decoding = sum(len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens == 1
                       for r in self.running)
        return decoding, len(self.running) - decoding

    def _free_seats_for_urgent(self, out: SchedulerOutput) -> int:
        """With every seat (max_num_seqs) taken, each waiting request of a more urgent class takes
        the seat of the least urgent, latest running one, as in vLLM's priority policy: batch work
        can fill the batch but never keeps an interactive request out of it. The victim goes back
        to the head of its class, its full blocks still in the prefix cache. Returns the count."""
        freed = 0
        while (self.waiting and self.running and len(self.running) >= self.config.max_num_seqs
               and freed < self._num_waiting_before(self.running[-1].priority)):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            freed += 1
        return freed

    def _num_waiting_before(self, priority: int) -> int:
        return sum(self.waiting.count(p) for p in Priority if p < priority)

    def _schedule_running(self, out: SchedulerOutput, budget: int, prompt_budget: int) -> tuple[int, int]:
        """Every running request in order, a decode one token, a prefill a chunk of at most
        `prompt_budget` prompt tokens in all; a prefill that finds it spent waits a step, and the
        decodes after it still run. Returns what is left of both budgets."""
        # The hot loop of every step (one pass per running request): locals, and the allocation
        # tried once before the preemption loop, which only a full pool enters.
        running, allocate_slots, emit = self.running, self.kv.allocate_slots, self._emit
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens
            if num_new > 1:
                num_new = min(num_new, budget, prompt_budget)
                if num_new == 0:
                    index += 1
                    continue
                prompt_budget -= num_new
            if not allocate_slots(request, num_new) and not self._allocate_or_preempt(request, num_new, out):
                break
            emit(out, request, num_new)
            budget -= num_new
            index += 1
        return budget, prompt_budget

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, prompt_budget: int) -> int:
        while self.waiting and min(budget, prompt_budget) > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hits = self.kv.get_computed_blocks(request)
            num_hit_tokens = len(hits) * self.config.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget, prompt_budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.pop()
            self._start_running(request, num_hit_tokens)
            self._emit(out, request, num_new)
            budget -= num_new
            prompt_budget -= num_new
        return budget

    def _start_running(self, request: Request, num_hit_tokens: int) -> None:
        if request.num_cached_tokens < 0:
            # Prompt tokens only: a resumed request (model_worker.engine.llm_engine) may hit its outputs too.
            request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
            self.prefix_query_tokens += request.num_prompt_tokens
            self.prefix_hit_tokens += request.num_cached_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_running_key)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        request_id, output = request.request_id, request.output_token_ids
        num_prompt = len(request.prompt_token_ids)
        # A decode's token is an output token: sliced here, without token_slice's call.
        token_ids = output[start - num_prompt:end - num_prompt] if start >= num_prompt else request.token_slice(start, end)
        sample = end == num_prompt + len(output)
        params = request.sampling_params
        history = (request.prompt_token_ids, output) if sample and params.penalises_history else None
        prompt = request.prompt_token_ids if start < num_prompt - 1 and request.wants_prompt_logprobs else None
        out.sequences.append(ScheduledSequence(request_id, token_ids, start, self._block_tables[request_id],
                                               sample, params, len(output), history, prompt,
                                               request.grammar if sample else None))
        request.num_computed_tokens = end
        if request.timings.first_scheduled_s is None:
            request.timings.first_scheduled_s = self.clock()

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    # ---- after the step -----------------------------------------------------------------------

    def update(self, batch: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Append each sampled token to its request; return the requests that got one."""
        if len(sampled) != batch.num_sampling:
            raise RuntimeError(f"runner returned {len(sampled)} tokens for {batch.num_sampling} sequences")
        now = self.clock()
        if not batch.is_empty:
            self.step_budget.record(*self._scheduled_mix, now - self._scheduled_s)
        tokens = iter(sampled)
        progressed = []
        # Once per sampled token of every step: the lookups hoisted, and the cheap tests of
        # update_block_hashes and _stop_status made here, their calls only when they do something.
        requests, running = self.requests, RequestStatus.RUNNING
        block_size = self.config.block_size if self.config.enable_prefix_caching else 0
        eos_token_ids = self.eos_token_ids
        for seq in batch.sequences:
            if not seq.sample:
                continue
            token = next(tokens)
            request = requests.get(seq.request_id)
            if request is None or request.status != running:
                continue
            output = request.output_token_ids
            output.append(token)
            if block_size and (len(request.prompt_token_ids) + len(output)) // block_size > len(request.block_hashes):
                request.update_block_hashes(block_size)
            timings = request.timings
            if timings.first_token_s is None:
                timings.first_token_s = now
            timings.token_times_s.append(now)
            progressed.append(request)
            params = request.sampling_params
            if (len(output) >= params.max_tokens or token in params.stop_token_ids
                    or (token in eos_token_ids and not params.ignore_eos)):
                self._finish(request, self._stop_status(request, token))
        return progressed

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.timings.finished_s = self.clock()
        del self.requests[request.request_id]
        self._release(request, status)

    def _release(self, request: Request, status: RequestStatus) -> None:
        """A request just finished: its blocks go back now and its end is reported this step."""
        self.kv.free(request)
        if status != RequestStatus.FINISHED_ABORTED:
            self._finished.append(request)

    # ---- observation --------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

