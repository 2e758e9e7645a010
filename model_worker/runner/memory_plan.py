"""Sizing the KV cache on a GPU from a profile of the worst steps the scheduler can produce.

The KV cache gets what the weights, the peak of one step and the CUDA graphs leave of
gpu_memory_utilization. A step's peak depends on its shape, not only its token count: a full
token budget of prompt read over a long paged context, or a full decode batch whose logits and
sampling buffers are (sequences x vocabulary) each. Profiling only a prefill from position 0
(what the runner did before) misses the second, so a full decode batch could run out of memory.
We profile each shape below and take the largest peak.

Profile steps read a context of max_model_len tokens, but their sequences all share one block
table of ceil(max_model_len / block_size) blocks, so the profile needs that many blocks, not one
context per sequence. What they write there is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.sampling import SamplingParams
from model_worker.sched.batch import ScheduledSequence, SchedulerOutput

# The sampling that needs the most memory: temperature, top-k and top-p on every row.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)


@dataclass(slots=True)
class ProfileStep:
    name: str
    batch: SchedulerOutput


def profile_steps(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                  graph_batch: int | None = None) -> tuple[list[ProfileStep], int]:
    """The worst steps, and the number of KV blocks they use (block ids [0, that number)).

    graph_batch: the largest decode batch captured in a CUDA graph; its step is profiled too (as
    "graph_decode_batch"), as the estimate of the memory the graphs keep.
    """
    context_blocks = -(-max_model_len // block_size)
    table = list(range(context_blocks))
    budget = max_num_batched_tokens
    num_seqs = max(1, min(max_num_seqs, budget))

    def sequence(name: str, num_tokens: int, start: int) -> ScheduledSequence:
        return ScheduledSequence(request_id=name, token_ids=[0] * num_tokens, start_position=start,
                                 block_table=table[: -(-(start + num_tokens) // block_size)], sample=True,
                                 sampling_params=PROFILE_SAMPLING)

    def step(name: str, sequences: list[ScheduledSequence]) -> ProfileStep:
        return ProfileStep(name, SchedulerOutput(sequences=sequences,
                                                 num_scheduled_tokens=sum(len(s.token_ids) for s in sequences)))

    chunk = min(budget, max_model_len)
    steps = [
        # The whole budget as one chunk at the end of the longest context.
        step("long_prefill_chunk", [sequence("chunk", chunk, max_model_len - chunk)]),
        # The largest decode batch, every sequence at the longest context.
        step("full_decode_batch", [sequence(f"decode-{i}", 1, max_model_len - 1) for i in range(num_seqs)]),
        # The budget split over as many prompts as may run, each from position 0.
        step("many_prefills", [sequence(f"prompt-{i}", n, 0)
                               for i, n in enumerate(_split(min(budget, num_seqs * max_model_len), num_seqs)) if n]),
    ]
    if num_seqs > 1 and budget > num_seqs - 1:
        # Decodes beside one chunk of what is left of the budget, as a running batch admits a prompt.
        rest = min(budget - (num_seqs - 1), max_model_len)
        steps.append(step("decodes_with_chunk", [sequence(f"decode-{i}", 1, max_model_len - 1)
                                                 for i in range(num_seqs - 1)]
                          + [sequence("chunk", rest, max_model_len - rest)]))
    if graph_batch is not None:
        steps.append(step("graph_decode_batch", [sequence(f"graph-{i}", 1, max_model_len - 1)
                                                 for i in range(graph_batch)]))
    return steps, context_blocks


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def kv_budget_bytes(total_bytes: int, free_bytes: int, utilization: float, weights_bytes: int,
                    step_peak_bytes: int, graph_bytes: int) -> int:
    """Bytes the KV cache may take: utilization of the whole GPU, less the weights, the peak of
    the worst step and the CUDA graphs' memory; never more than is free now less those two (other
    processes on the GPU)."""
    planned = total_bytes * utilization - weights_bytes - step_peak_bytes - graph_bytes
    return int(min(planned, free_bytes - step_peak_bytes - graph_bytes))


def graph_batch_for(max_num_seqs: int, max_num_batched_tokens: int, max_graph_batch: int) -> int:
    """The largest decode batch worth capturing: no step has more sequences than either limit."""
    return max(1, min(max_num_seqs, max_num_batched_tokens, max_graph_batch))
