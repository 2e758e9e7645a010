"""LLMEngine: a step is schedule -> execute -> update.

The engine owns a scheduler (pure Python) and a model runner (torch). Only the scheduler changes
request state; the engine turns sampled tokens into outputs. Text is an OutputProcessor's job:
used alone, the engine runs one after each step (`detokenize=True`); inside an AsyncLLMEngine's
engine loop it emits token ids only and the stream side makes the text (`detokenize=False`).

A step that raises fails only the requests that caused it (model_worker/engine/fault_isolation.py): they
finish with finish_reason "error" and an `error` message, their half-written KV blocks leave the
prefix cache, and the rest of the batch goes on. A runner that fails with no request to blame
requeues the batch; after MAX_RUNNER_FAILURES_IN_A_ROW such steps, step() raises EngineBroken, so
that the replica is replaced rather than left half alive.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

from contracts.engine_stats import EngineStats
from contracts.sampling import GrammarError, SamplingParams
from contracts.serving import GenerationChunk, RequestTimings
from model_worker.sched.batch import ModelRunner, ScheduledSequence, SchedulerOutput
from model_worker.sched.block_pool import BlockPool
from model_worker.config import EngineConfig, SchedulerConfig
from model_worker.engine.fault_isolation import IsolatedStep, execute_isolating
from model_worker.engine.output_processor import OutputProcessor
from model_worker.sched.request import Priority, Request, RequestStatus
from model_worker.sched.request_checks import RequestChecker, RequestRejected
from model_worker.sched.selector import make_scheduler
from model_worker.engine.stats import RollingStats
from model_worker.engine.step_padding import PaddedRunner

# Steps in a row that the runner failed with no request to blame (its probe failed too) before
# the engine gives up. One is a transient fault (a CUDA OOM spike, an interrupted kernel); three in
# a row with every request requeued each time is a broken device.
MAX_RUNNER_FAILURES_IN_A_ROW = 3


class EngineBroken(RuntimeError):
    """The runner keeps failing without any request's fault: the engine cannot serve."""


@dataclass(slots=True)
class StepUpdate:
    """What running one scheduled batch did, before any output is made."""

    # Requests that got a token this step, in batch order.
    progressed: list[Request]
    # Error outputs of the requests the step failed on, by request id.
    failed: dict[str, GenerationChunk]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model_runner: ModelRunner | None = None,
                 tokenizer: Any = None, eos_token_ids: Sequence[int] | None = None,
                 clock: Callable[[], float] = time.monotonic, detokenize: bool = True) -> None:
        config = config or EngineConfig()
        if model_runner is None:
            config, model_runner = _build_runner(config)
            tokenizer = tokenizer if tokenizer is not None else model_runner.tokenizer
        if config.emulated_step_time_s > 0:
            model_runner = PaddedRunner(model_runner, config.emulated_step_time_s)
        self.config = config
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.clock = clock
        self.vocab_size: int | None = model_runner.vocab_size
        if eos_token_ids is None:
            eos_token_ids = model_runner.eos_token_ids
        scheduler_config = SchedulerConfig(
            block_size=config.block_size,
            num_kv_blocks=model_runner.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=model_runner.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            batching=config.batching,
            max_decode_slowdown=config.max_decode_slowdown,
        )
        self.scheduler = make_scheduler(scheduler_config, eos_token_ids, clock)
        self.checks = RequestChecker(tokenizer, self.vocab_size, scheduler_config)
        # Text and stop strings, after each step; off when a consumer of the token ids makes the
        # text itself (AsyncLLMEngine), so that the step loop never decodes.
        self.detokenize = detokenize
        self.outputs = OutputProcessor(tokenizer)
        self._rolling = RollingStats(config.stats_window)
        self.num_steps = 0
        # Seconds spent in schedule() and execute_and_update(), over every step that ran a batch.
        self.step_time_s = 0.0
        self._step_began_s = 0.0
        self.num_prompt_tokens_total = 0
        self.num_generated_tokens_total = 0
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        # Steps the runner failed with no request to blame, in a row and in all.
        self.num_runner_failures_in_a_row = 0
        self.num_runner_failures = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    priority: Priority | str | int = Priority.INTERACTIVE, arrival_time: float | None = None,
                    cache_key: str | None = None, resumed_token_ids: Sequence[int] = (),
                    block_hashes: Sequence[int] | None = None) -> Request:
        """Queue a request; raise RequestRejected (a ValueError) if it can never be served.

        `block_hashes` are the prompt's chained block hashes as the caller computed them (the
        ingress does, with the cache key, for its router): the prefix cache uses them as sent,
        after RequestChecker.check_block_hashes, instead of hashing the prompt again.

        `resumed_token_ids` are output tokens another engine already produced for this request (the
        ingress migrates a request whose replica died): it continues after them exactly as a
        preempted request would, its prompt and those tokens recomputed, seeded draws indexed from
        there, max_tokens counting them, and their text never emitted again."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("request_id must be a non-empty string", param="request_id")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestRejected("params must be a SamplingParams", param="params")
        prompt_token_ids, resumed, hashes = self.checks.check(prompt, params, resumed_token_ids, block_hashes,
                                                              cache_key)
        return self.add_checked_request(request_id, prompt_token_ids, params, Priority.parse(priority),
                                        self.clock() if arrival_time is None else arrival_time,
                                        cache_key, resumed, hashes)

    def add_checked_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            priority: Priority, arrival_s: float, cache_key: str | None, resumed: list[int],
                            block_hashes: list[int]) -> Request:
        """Queue a request that already passed `self.checks.check` (AsyncLLMEngine runs it where
        the request comes in): the engine loop does not scan a prompt a second time between two
        steps. The scheduler still refuses a duplicate id or a request larger than the whole KV
        cache, its own invariants."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            priority=priority,
            timings=RequestTimings(arrival_s=arrival_s),
            cache_key=cache_key,
            output_token_ids=resumed,
            block_hashes=block_hashes,
        )
        if params.structured is not None:
            request.grammar = self._matcher(params, resumed)
        self.scheduler.add_request(request)
        if self.detokenize:
            self.outputs.add(request_id, request.prompt_token_ids, params.stop, resumed)
        self.num_prompt_tokens_total += request.num_prompt_tokens
        return request

    def _matcher(self, params: SamplingParams, resumed: list[int]) -> Any:
        """A new grammar matcher for the request, past its resumed tokens; RequestRejected for a
        grammar this engine cannot use."""
        compiler_of = getattr(self.runner, "grammar_compiler", None)
        structured = params.structured
        if compiler_of is None:
            raise RequestRejected("this engine's model runner has no structured output", param=structured.param)
        try:
            matcher = compiler_of().matcher(structured)
        except GrammarError as exc:
            raise RequestRejected(str(exc), param=exc.param) from None
        for token in resumed:
            if not matcher.accept(token):
                raise RequestRejected(f"resumed token {token} does not follow the request's grammar",
                                      param="resumed_token_ids")
        return matcher

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state; its blocks are free when this returns."""
        self.outputs.remove(request_id)
        aborted = self.scheduler.abort(request_id)
        if aborted:
            self.num_finished["abort"] += 1
        return aborted

    def stop(self, request_id: str, stop_reason: str) -> None:
        """Finish a live request on a stop string its consumer found in the text; the next step
        reports it finished ("stop"). A request that already finished is left as it is."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop_reason)

    def fail(self, request_id: str, message: str) -> None:
        """End a live request with an error found outside the step (its consumer could not
        detokenize it); its blocks are freed at once and it is not reported."""
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self._fail(request, message)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks replaying a workload start cold). Only while no
        request is live; returns False, changing nothing, otherwise."""
        if self.scheduler.has_unfinished():
            return False
        self.scheduler.kv.pool.reset_prefix_cache()
        return True

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[GenerationChunk]:
        """Schedule, run the batch, update: an output for every request that progressed or ended."""
        update = self.execute_and_update(self.schedule())
        outputs = update.failed
        for request in update.progressed:
            outputs[request.request_id] = self._progress_output_or_error(request)
        for request in self.take_finished():
            self._finish_output(request, outputs)
        self.runner.sampled_logprobs.clear()  # any left belong to tokens the step dropped
        return list(outputs.values())

    # ---- the phases of a step ------------------------------------------------------------------
    # step() runs them back to back. The cluster simulator (simulator/replica.py) runs this engine
    # over a simulated runner and lets simulated time pass between schedule() and
    # execute_and_update(): the step time its step-time model predicts for the batch.

    def schedule(self) -> SchedulerOutput:
        """The next step's batch (empty when nothing can run)."""
        self._step_began_s = self.clock()
        return self.scheduler.schedule()

    def execute_and_update(self, batch: SchedulerOutput) -> StepUpdate:
        """Run the scheduled batch and apply its sampled tokens. The requests a failure blames
        get their error output in `failed`; a failure with no culprit requeues the batch."""
        failed: dict[str, GenerationChunk] = {}
        sampled: list[int] = []
        if not batch.is_empty:
            batch, sampled = self._execute(batch, failed)
            if self.runner.prompt_logprobs:
                self._keep_prompt_logprobs()
        progressed = self.scheduler.update(batch, sampled)
        now_s = self.clock()
        if not batch.is_empty:
            self.num_steps += 1
            self.step_time_s += now_s - self._step_began_s
        self._rolling.record_tokens(now_s, len(progressed))
        self.num_generated_tokens_total += len(progressed)
        return StepUpdate(progressed, failed)

    def _keep_prompt_logprobs(self) -> None:
        """The step's prompt logprobs into their requests, each at its prompt positions (a chunk
        computed again, after a failed step or a preemption, writes the same entries again)."""
        requests = self.scheduler.requests
        for request_id, (first, entries) in self.runner.prompt_logprobs.items():
            request = requests.get(request_id)
            if request is None or not request.wants_prompt_logprobs:
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None] * request.num_prompt_tokens
            request.prompt_logprobs[first:first + len(entries)] = entries
        self.runner.prompt_logprobs.clear()

    def take_finished(self) -> list[Request]:
        """The requests that finished since the last call (aborted and failed ones are not
        reported), counted by finish reason and into the TTFT window."""
        finished = self.scheduler.take_finished()
        for request in finished:
            self.num_finished[request.status.finish_reason] += 1
            if request.timings.ttft_s is not None:
                self._rolling.record_ttft(request.timings.ttft_s)
        return finished

    # ---- fault containment ---------------------------------------------------------------------

    def _execute(self, batch: SchedulerOutput, outputs: dict[str, GenerationChunk]) -> tuple[SchedulerOutput, list[int]]:
        """The runner over the batch; the sequences that ran and their tokens. Culprits of a
        failure get an error output; a failure with no culprit requeues the batch."""
        isolated = execute_isolating(self.runner.execute, batch, self._probe_runner)
        if isolated.runner_error is not None:
            self._runner_failed(batch, isolated.runner_error)
            return SchedulerOutput(), []
        self.num_runner_failures_in_a_row = 0
        if not isolated.culprits:
            return isolated.batch, isolated.sampled
        return self._drop_culprits(isolated, outputs)

    def _drop_culprits(self, isolated: IsolatedStep, outputs: dict[str, GenerationChunk]
                       ) -> tuple[SchedulerOutput, list[int]]:
        """Fail each culprit. A survivor that reads a block a culprit was to write this step (a
        prefix hit taken in the same step) read garbage: it is recomputed, its token dropped."""
        tainted: set[int] = set()
        for seq, exc in isolated.culprits:
            written = self._written_block_ids(seq)
            tainted.update(written)
            self.scheduler.kv.uncache(written)
            request = self.scheduler.requests.get(seq.request_id)
            if request is not None:  # (a static batch's padding row belongs to no live request)
                outputs[request.request_id] = self._fail(request, f"the model failed on this request: "
                                                                  f"{type(exc).__name__}: {exc}")
        kept: list[ScheduledSequence] = []
        kept_tokens: list[int] = []
        tokens = iter(isolated.sampled)
        for seq in isolated.batch.sequences:
            token = next(tokens) if seq.sample else None
            if tainted.intersection(seq.block_table[:self._num_blocks(seq.context_len)]):
                self.scheduler.kv.uncache(self._written_block_ids(seq))
                self.scheduler.requeue(seq.request_id)
                continue
            kept.append(seq)
            if token is not None:
                kept_tokens.append(token)
        return SchedulerOutput(sequences=kept, num_scheduled_tokens=sum(len(q.token_ids) for q in kept)), kept_tokens

    def _runner_failed(self, batch: SchedulerOutput, error: BaseException) -> None:
        """No request to blame: every request of the step is recomputed later; give up after a few."""
        self.num_runner_failures += 1
        self.num_runner_failures_in_a_row += 1
        for seq in reversed(batch.sequences):  # reversed: requeued to the front, they keep their order
            self.scheduler.kv.uncache(self._written_block_ids(seq))
            self.scheduler.requeue(seq.request_id)
        if self.num_runner_failures_in_a_row >= MAX_RUNNER_FAILURES_IN_A_ROW:
            raise EngineBroken(f"the model runner failed {self.num_runner_failures_in_a_row} steps in a row, "
                               f"a one-token probe included: {type(error).__name__}: {error}") from error

    def _probe_runner(self) -> BaseException | None:
        """A one-token forward that no request owns, in a block borrowed from the pool: None if the
        runner works. Without a free block there is no probe, and the runner is presumed to work
        (so requests that fail alone are still the ones blamed)."""
        pool = self.scheduler.kv.pool
        if pool.num_free_blocks == 0:
            return None
        (block,) = pool.allocate(1)
        probe = ScheduledSequence(request_id="iterserve-probe", token_ids=[0], start_position=0,
                                  block_table=[block.block_id], sample=True,
                                  sampling_params=SamplingParams(max_tokens=1, temperature=0.0))
        try:
            self.runner.execute(SchedulerOutput(sequences=[probe], num_scheduled_tokens=1))
        except Exception as exc:
            return exc
        finally:
            pool.free([block])
        return None

    def _written_block_ids(self, seq: ScheduledSequence) -> list[int]:
        """Blocks this step writes into: from the one holding start_position to the last."""
        return seq.block_table[seq.start_position // self.config.block_size:self._num_blocks(seq.context_len)]

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _fail(self, request: Request, message: str) -> GenerationChunk:
        """End a live request with an error output; its blocks are freed at once."""
        self.outputs.remove(request.request_id)
        self.scheduler.abort(request.request_id)
        self.num_finished["error"] += 1
        return GenerationChunk(request_id=request.request_id, finished=True, finish_reason="error", error=message,
                             num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                             num_cached_tokens=max(request.num_cached_tokens, 0), timings=request.timings)

    def _progress_output_or_error(self, request: Request) -> GenerationChunk:
        """A tokenizer that raises on one request's tokens fails that request alone."""
        try:
            return self._progress_output(request)
        except Exception as exc:
            return self._fail(request, f"making this request's output failed: {type(exc).__name__}: {exc}")

    def _advance_grammar(self, request: Request) -> None:
        """The kept token into the request's matcher; a complete grammar finishes the request (as
        EOS would, and also when EOS is ignored)."""
        token = request.output_token_ids[-1]
        if not request.grammar.accept(token):
            raise RuntimeError(f"token {token} does not follow the request's grammar")
        if request.grammar.is_terminated() and not request.status.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _progress_output(self, request: Request) -> GenerationChunk:
        if request.grammar is not None:
            self._advance_grammar(request)
        out = GenerationChunk(request_id=request.request_id, token_ids=[request.output_token_ids[-1]],
                              num_prompt_tokens=request.num_prompt_tokens,
                              num_output_tokens=request.num_output_tokens,
                              num_cached_tokens=max(request.num_cached_tokens, 0))
        if request.sampling_params.logprobs is not None:
            logprobs = self.runner.sampled_logprobs.pop(request.request_id, None)
            if logprobs is None:
                raise RuntimeError("the model runner returned no logprobs for the sampled token")
            out.logprobs = [logprobs]
        if request.wants_prompt_logprobs:  # the first output token: the prompt's are all computed
            out.prompt_logprobs = request.prompt_logprobs or [None] * request.num_prompt_tokens
            request.prompt_logprobs, request.prompt_logprobs_sent = None, True
        if self.detokenize:
            stop = self.outputs.add_tokens(out)
            if stop is not None and not request.status.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        return out

    def _finish_output(self, request: Request, outputs: dict[str, GenerationChunk]) -> None:
        out = outputs.get(request.request_id)
        if out is None:
            out = outputs[request.request_id] = GenerationChunk(
                request_id=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                num_cached_tokens=max(request.num_cached_tokens, 0))
        self.outputs.finish(out)
        out.finished = True
        out.finish_reason = request.status.finish_reason
        out.stop_reason = request.stop_reason
        out.timings = request.timings

    # ---- observation --------------------------------------------------------------------------

    def stats(self, include_block_hashes: bool = False, block_hashes_since: int | None = None) -> EngineStats:
        """The engine's state now. include_block_hashes: every hash the prefix cache holds; with
        block_hashes_since too, only the changes since that cache_seq when the pool still has them
        (EngineStats.block_hashes_since says which came)."""
        scheduler = self.scheduler
        pool = scheduler.kv.pool
        queries = scheduler.prefix_query_tokens
        return EngineStats(
            num_waiting=scheduler.num_waiting,
            num_waiting_interactive=scheduler.waiting.count(Priority.INTERACTIVE),
            num_waiting_batch=scheduler.waiting.count(Priority.BATCH),
            num_running=scheduler.num_running,
            num_free_kv_blocks=pool.num_free_blocks,
            num_total_kv_blocks=pool.num_blocks,
            num_cached_kv_blocks=pool.num_cached_blocks,
            kv_usage=scheduler.kv.usage,
            block_size=scheduler.config.block_size,
            max_model_len=scheduler.config.max_model_len,
            prefix_cache_query_tokens=queries,
            prefix_cache_hit_tokens=scheduler.prefix_hit_tokens,
            prefix_cache_hit_rate=scheduler.prefix_hit_tokens / queries if queries else 0.0,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            prompt_tokens_total=self.num_prompt_tokens_total,
            generation_tokens_total=self.num_generated_tokens_total,
            requests_finished=dict(self.num_finished),
            tokens_per_s=self._rolling.tokens_per_s(self.clock()),
            step_time_s=self.step_time_s,
            forward_time_s=self.runner.forward_time_s,
            execute_time_s=self.runner.execute_time_s,
            **self._rolling.ttft_percentiles(),
            cache_seq=pool.cache_seq,
            **_block_hash_fields(pool, include_block_hashes, block_hashes_since),
        )


def _block_hash_fields(pool: BlockPool, include_block_hashes: bool, since: int | None) -> dict[str, Any]:
    """EngineStats' hash fields: none, the changes since `since`, or (a gap, or no `since`) all."""
    if not include_block_hashes:
        if since is not None:
            raise ValueError("block_hashes_since needs include_block_hashes=True")
        return {}
    changes = pool.changes_since(since) if since is not None else None
    if changes is None:
        return {"cached_block_hashes": tuple(pool.cached_hashes())}
    stored, removed = changes
    return {"block_hashes_since": since, "stored_block_hashes": tuple(stored), "removed_block_hashes": tuple(removed)}


def _build_runner(config: EngineConfig) -> tuple[EngineConfig, ModelRunner]:
    """The torch runner, imported here so the engine imports without torch."""
    from model_worker.checkpoints.models import resolve_model

    config = dataclasses.replace(config, model=resolve_model(config.model))
    started_s = time.perf_counter()
    from model_worker.runner.model_runner import TorchModelRunner
    imports_s = time.perf_counter() - started_s  # torch and transformers: a new process's fixed cost
    runner = TorchModelRunner(config)
    runner.load_times_s = {"imports": imports_s, **runner.load_times_s}
    return config, runner
