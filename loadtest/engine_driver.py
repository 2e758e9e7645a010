"""Drives our LLMEngine offline through a workload, and measures its forward-time efficiency.

Takes the engine and the SamplingParams class as arguments and imports neither torch nor the engine,
so the driver can be exercised against a stub engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.results import RequestResult
from loadtest.traces import BenchRequest, build_prompt

Clock = Callable[[], float]


def run_engine(engine: Any, workload: list[BenchRequest], make_params: Callable[[int], Any],
               clock: Clock = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
               ) -> list[RequestResult]:
    """Submit each request when its arrival time has come, step until all finish, and note when
    each request's first token and final output reach the caller (seconds since the start).

    make_params(n) must give greedy params for exactly n tokens with EOS ignored. When nothing is
    running, sleep until the next arrival rather than spin on empty steps.
    """
    pending = deque(sorted(workload, key=lambda r: r.arrival_s))
    records = {r.request_id: RequestResult.offline(r.request_id, r.arrival_s, r.output_tokens) for r in pending}
    num_tokens = dict.fromkeys(records, 0)
    start = clock()
    while pending or engine.has_unfinished():
        now = clock() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            engine.add_request(r.request_id, list(r.prompt_token_ids), make_params(r.output_tokens))
        if not engine.has_unfinished():
            sleep(max(0.0, pending[0].arrival_s - now))
            continue
        outputs = engine.step()
        t = clock() - start
        for out in outputs:
            rec = records[out.request_id]
            if out.token_ids:
                num_tokens[out.request_id] += len(out.token_ids)
                if rec.first_token_s is None:
                    rec.first_token_s = t
            if out.finished:
                rec.finish_s = t
    wrong = {rid: n for rid, n in num_tokens.items() if n != records[rid].output_tokens}
    if wrong:
        rid = next(iter(wrong))
        raise RuntimeError(f"{len(wrong)} requests got the wrong number of tokens, e.g. {rid}: "
                           f"{wrong[rid]} instead of {records[rid].output_tokens}")
    return list(records.values())


def decode_steps_alone(engine: Any, request_id: str, prompt: list[int], params: Any,
                       clock: Clock = time.perf_counter) -> list[float]:
    """Run one request alone to the end: the seconds of each of its decode steps (the steps after
    its first token; its prompt steps are not counted)."""
    engine.add_request(request_id, prompt, params)
    steps: list[float] = []
    decoding = False
    while engine.has_unfinished():
        started = clock()
        outputs = engine.step()
        if decoding:
            steps.append(clock() - started)
        decoding = decoding or any(out.token_ids for out in outputs)
    return steps


@dataclass(slots=True, frozen=True)
class Efficiency:
    # Seconds in model forward over the window, as the runner counts them (stats().forward_time_s).
    forward_s: float
    # Wall seconds of the window: the sum of its step() calls, back to back. The driver's own
    # stats() reads between steps are left out: they are the measurement, not the engine.
    wall_s: float
    num_steps: int
    # Tokens the steps in the window produced (one per running request per decode step).
    num_tokens: int

    @property
    def efficiency(self) -> float:
        return self.forward_s / self.wall_s if self.wall_s > 0 else 0.0


def measure_efficiency(engine: Any, make_params: Callable[[int], Any], token_pool: np.ndarray,
                       num_seqs: int = 32, prompt_tokens: int = 64, max_tokens: int = 128, seed: int = 1234,
                       clock: Clock = time.perf_counter) -> Efficiency:
    """Forward time / wall time over the steady window where all `num_seqs` requests are running.

    All requests are added at once; a step is in the window when it starts with `num_seqs`
    running and none waiting (prefill chunks of the last admitted prompts included, which only
    helps the forward share a little). Its wall time is everything step() does: scheduling, input
    preparation, the forward, sampling, output building.
    """
    rng = np.random.default_rng(seed)
    for i in range(num_seqs):
        engine.add_request(f"eff-{seed}-{i}", list(build_prompt(prompt_tokens, token_pool, rng)),
                           make_params(max_tokens))
    forward_s = wall_s = 0.0
    num_steps = num_tokens = 0
    while engine.has_unfinished():
        stats = engine.stats()
        in_window = stats.num_running == num_seqs and stats.num_waiting == 0
        forward_before = stats.forward_time_s
        t0 = clock()
        outputs = engine.step()
        t1 = clock()
        if in_window:
            forward_s += engine.stats().forward_time_s - forward_before
            wall_s += t1 - t0
            num_steps += 1
            num_tokens += sum(len(o.token_ids) for o in outputs)
    if num_steps == 0:
        raise RuntimeError(f"never had {num_seqs} requests running at once: raise max_num_seqs or the KV cache")
    return Efficiency(forward_s, wall_s, num_steps, num_tokens)
