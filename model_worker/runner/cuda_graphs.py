"""CUDA graphs for decode-only steps, and step inputs sent to the GPU without a host sync.

A decode step of a small batch is dozens of kernel launches per layer, each a few microseconds of
host time, for kernels that each run for about as long: the GPU waits on the host. A CUDA graph
records the launches of one forward once and replays them with one call. A graph replays the
same kernels on the same addresses, so every input of a captured forward lives in a static
buffer that each step refills, and the batch is padded up to the nearest captured size
(1, 2, 4, 8, then every 8, as vLLM and SGLang do). Padded rows have context length 0 and slot
-1: our Triton kernels (attention/triton_kernels.py) write no K/V for them and read none.

Only decode-only steps whose batch fits the largest captured size replay a graph; prefill chunks,
mixed steps and larger batches run eagerly. The attention must be the Triton backend: its
metadata is all tensors, while the torch backend plans Python-side per step.

The host syncs once per step, when it reads the sampled token ids. Inputs go up through one
pinned buffer and asynchronous copies (`Uploader`); a plain `tensor.to("cuda")` from pageable
memory waits for the GPU to drain first.

`capture` takes the graph API as an argument, so the buffer handling, the padding and the bucket
choice are tested on CPU with a stand-in that replays by running the forward again over the same
static buffers (tests/integration/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from model_worker.runner.attention.base import StepLayout
from model_worker.runner.attention.triton_kernels import TileLaunch, TritonAttentionMetadata
from model_worker.runner.uploader import Uploader

# The largest batch captured by default: beyond it a decode step is long enough that launches
# are a small share of it.
DEFAULT_MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch, which is always included."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


@dataclass(slots=True)
class GraphAPI:
    """How to capture and replay: torch.cuda's, or a stand-in in tests.

    capture(fn, pool) runs fn under capture and returns (graph, output); graph.replay() reruns it.
    """

    capture: Callable[[Callable[[], torch.Tensor], Any], tuple[Any, torch.Tensor]]
    new_pool: Callable[[], Any]


def cuda_graph_api() -> GraphAPI:
    def capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    return GraphAPI(capture=capture, new_pool=torch.cuda.graph_pool_handle)


class DecodeGraphs:
    """Captured decode forwards at bucketed batch sizes, over static input buffers.

    forward(input_ids, positions, kv_caches, metadata, logits_indices) is the model's forward
    (LlamaDecoder.forward); it must read nothing but its arguments and the weights.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, max_batch: int, max_blocks_per_seq: int, api: GraphAPI) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.api = api
        # Static inputs, one region each in one int64 buffer: ids, positions, slots, start positions,
        # context lengths (B each), then block tables (B, max_blocks_per_seq).
        batch = self.max_batch
        self._static = torch.zeros(5 * batch + batch * max_blocks_per_seq, dtype=torch.int64, device=device)
        regions = self._static[:5 * batch].view(5, batch)
        self.input_ids, self.positions, self.slot_mapping, self.start_positions, self.context_lens = regions
        self.block_tables = self._static[5 * batch:].view(batch, max_blocks_per_seq)
        # Fixed for every decode step: one query token per sequence, every row sampled.
        self.query_starts = torch.arange(batch + 1, dtype=torch.int64, device=device)
        self.tile_seqs = torch.arange(batch, dtype=torch.int64, device=device)
        self.tile_offsets = torch.zeros(batch, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(batch, dtype=torch.int64, device=device)
        self.uploader = Uploader(device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.num_replays = 0

    def _metadata(self, size: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_starts=self.query_starts[:size + 1], start_positions=self.start_positions[:size],
            context_lens=self.context_lens[:size],
            launches=[TileLaunch(self.tile_seqs[:size], self.tile_offsets[:size], 1)])

    def _run(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size),
                            self.logits_indices[:size])

    def capture_all(self) -> None:
        """Capture every size, largest first, in one memory pool (smaller graphs reuse its blocks).
        Each is run once eagerly first, so Triton compiles its kernels outside the capture."""
        self._pad_inputs(0)  # every row padding: context 0, slot -1, writes nothing
        pool = self.api.new_pool()
        for size in reversed(self.sizes):
            self._run(size)
            self.graphs[size] = self.api.capture(lambda size=size: self._run(size), pool)

    def _pad_inputs(self, num_real: int) -> None:
        self.slot_mapping[num_real:].fill_(-1)
        self.context_lens[num_real:].zero_()
        self.start_positions[num_real:].zero_()
        self.positions[num_real:].zero_()
        self.input_ids[num_real:].zero_()

    def can_run(self, layout: StepLayout, sample_all: bool) -> bool:
        num_seqs = len(layout.query_lens)
        return (bool(self.graphs) and sample_all and num_seqs <= self.max_batch
                and layout.block_tables.shape[1] <= self.max_blocks_per_seq and bool((layout.query_lens == 1).all()))

    def run(self, input_ids: np.ndarray, positions: np.ndarray, layout: StepLayout) -> torch.Tensor:
        """Logits (num_seqs, vocab) of a decode step that can_run() accepted."""
        num_seqs = len(layout.query_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        width = layout.block_tables.shape[1]
        # Rows past num_seqs, up to size, are padding: slot -1, context 0. Block-table columns past
        # a row's table are never read (positions < context length only).
        pad = size - num_seqs
        minus_one = np.full(pad, -1, dtype=np.int64)
        zeros = np.zeros(pad, dtype=np.int64)
        ids, pos, slots, starts, contexts, tables = self.uploader([
            np.concatenate([input_ids, zeros]), np.concatenate([positions, zeros]),
            np.concatenate([layout.slot_mapping, minus_one]), np.concatenate([layout.start_positions, zeros]),
            np.concatenate([layout.context_lens, zeros]), layout.block_tables])
        self.input_ids[:size].copy_(ids)
        self.positions[:size].copy_(pos)
        self.slot_mapping[:size].copy_(slots)
        self.start_positions[:size].copy_(starts)
        self.context_lens[:size].copy_(contexts)
        self.block_tables[:num_seqs, :width].copy_(tables)
        graph, logits = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return logits[:num_seqs]
