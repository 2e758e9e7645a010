"""Steps padded to an accelerator's duration, for benchmarks: a wrapper around a model runner.

On a GPU a decode step keeps the device busy, not the host; on a 2-core CPU the host is the
device. Benchmarks that measure replicas, routing or autoscaling rather than the model
(`EngineConfig.emulated_step_time_s`) make every execute() last at least that long, sleeping out
the rest, so replicas, not this machine's cores, set the pace. The engine's step knows nothing
of it: LLMEngine wraps its runner in a PaddedRunner when the setting is above 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from model_worker.sched.batch import ModelRunner, SchedulerOutput


class PaddedRunner:
    """`runner`, with each non-empty execute() lasting at least step_time_s."""

    def __init__(self, runner: ModelRunner, step_time_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.runner = runner
        self.step_time_s = step_time_s
        self._clock = clock
        self._sleep = sleep

    def execute(self, batch: SchedulerOutput) -> list[int]:
        started_s = self._clock()
        sampled = self.runner.execute(batch)
        remaining_s = self.step_time_s - (self._clock() - started_s)
        if batch.sequences and remaining_s > 0:
            self._sleep(remaining_s)
        return sampled

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def eos_token_ids(self) -> Sequence[int]:
        return self.runner.eos_token_ids

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def forward_time_s(self) -> float:
        return self.runner.forward_time_s

    @property
    def execute_time_s(self) -> float:
        return self.runner.execute_time_s

    @property
    def load_times_s(self) -> dict[str, float]:
        return self.runner.load_times_s

    @property
    def sampled_logprobs(self) -> dict[str, tuple[float, list[int], list[float]]]:
        return self.runner.sampled_logprobs

    @property
    def prompt_logprobs(self) -> dict[str, tuple[int, list[tuple[float, list[int], list[float]]]]]:
        return self.runner.prompt_logprobs

    def grammar_compiler(self) -> Any:
        return self.runner.grammar_compiler()
