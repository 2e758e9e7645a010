"""The torch backend: F.scaled_dot_product_attention over K/V gathered from the paged cache.

Correct on CPU and CUDA, and the fast path on CPU. Decodes of similar context length run as one
batched SDPA over their gathered blocks; each prefill chunk runs as its own SDPA, over its own
K/V when it starts the sequence and over its gathered context otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from model_worker.runner.attention.base import AttentionBackend, StepLayout, write_kv


@dataclass(slots=True)
class PrefillChunk:
    token_start: int
    token_end: int
    context_len: int
    # None when the chunk starts the sequence: it attends only to itself, causally, and reads its
    # K/V straight from the projections. Otherwise the blocks holding positions [0, context_len)
    # and a (query_len, context_len) bool mask, causal offset by the start position.
    context_block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one query token and similar context lengths, run as one batched SDPA."""

    token_indices: torch.Tensor  # (G,) rows in the packed tokens
    # Whole blocks are gathered, not single slots: one contiguous copy of block_size rows is far
    # cheaper on CPU than block_size scattered ones.
    block_ids: torch.Tensor  # (G * max_blocks,) block tables, right-padded with block 0
    mask: torch.Tensor  # (G, 1, 1, max_blocks * block_size) bool, True where the key is real


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,)
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


# Decode attention reads every padded key, so decodes are split into groups of similar context
# length. A group costs a few extra kernel launches per layer, worth about this many block-rows of
# attention on CPU (about 60 us at ~8 GB/s); a split is taken only if it saves more than that.
_GROUP_OVERHEAD_BLOCK_ROWS = 32
_MAX_DECODE_GROUPS = 4


def split_decode_groups(num_blocks_sorted: np.ndarray) -> list[tuple[int, int]]:
    """Cut rows sorted by ascending block count into at most _MAX_DECODE_GROUPS [start, end)
    ranges, greedily taking the split that removes the most padded block-rows each time."""
    groups = [(0, len(num_blocks_sorted))]
    while len(groups) < _MAX_DECODE_GROUPS:
        best_saving, best = _GROUP_OVERHEAD_BLOCK_ROWS, None
        for index, (start, end) in enumerate(groups):
            if end - start < 2:
                continue
            # Splitting before row k pads rows [start, k) to num_blocks[k - 1] instead of num_blocks[end - 1].
            lower_max = num_blocks_sorted[start:end - 1]
            savings = np.arange(1, end - start) * (num_blocks_sorted[end - 1] - lower_max)
            k = int(savings.argmax())
            if savings[k] > best_saving:
                best_saving, best = savings[k], (index, start + k + 1)
        if best is None:
            break
        index, cut = best
        start, end = groups[index]
        groups[index:index + 1] = [(start, cut), (cut, end)]
    return groups


class TorchAttentionBackend(AttentionBackend):
    """F.scaled_dot_product_attention; correct on CPU and CUDA, and the fast path on CPU."""

    name = "torch"

    def __init__(self) -> None:
        # Grow-only buffer the decode path gathers K and V into, reused by every layer and step.
        # A fresh multi-megabyte tensor per layer costs more than the attention itself on CPU:
        # glibc serves it with new pages from the kernel, faulted in and zeroed each time.
        self._gather_buffer: torch.Tensor | None = None

    def _gather_buffers(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = math.prod(shape)
        buffer = self._gather_buffer
        if buffer is None or buffer.numel() < 2 * numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._gather_buffer = torch.empty(2 * numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape), buffer[numel:2 * numel].view(shape)

    def prepare(self, layout: StepLayout, device: torch.device) -> TorchAttentionMetadata:
        query_lens = layout.query_lens
        decode_rows = np.flatnonzero(query_lens == 1)
        groups = []
        if len(decode_rows):
            context_lens = layout.context_lens[decode_rows]
            order = np.argsort(context_lens, kind="stable")
            decode_rows, context_lens = decode_rows[order], context_lens[order]
            num_blocks = -(-context_lens // layout.block_size)
            for start, end in split_decode_groups(num_blocks):
                groups.append(self._decode_group(layout, decode_rows[start:end], context_lens[start:end],
                                                 int(num_blocks[end - 1]), device))
        prefills = prefill_chunks(layout, device)
        return TorchAttentionMetadata(slot_mapping=torch.from_numpy(layout.slot_mapping).to(device),
                                      decode_groups=groups, prefills=prefills)

    @staticmethod
    def _decode_group(layout: StepLayout, rows: np.ndarray, context_lens: np.ndarray, max_blocks: int,
                      device: torch.device) -> DecodeGroup:
        block_ids = np.ascontiguousarray(layout.block_tables[rows, :max_blocks])
        padded_len = max_blocks * layout.block_size
        mask = np.arange(padded_len)[None, :] < context_lens[:, None]
        return DecodeGroup(token_indices=torch.from_numpy(layout.query_starts[rows]).to(device),
                           block_ids=torch.from_numpy(block_ids.reshape(-1)).to(device),
                           mask=torch.from_numpy(mask).to(device).view(len(rows), 1, 1, padded_len))

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale):
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        for group in metadata.decode_groups:
            decode_q = q.index_select(0, group.token_indices)
            out.index_copy_(0, group.token_indices, self._decode(decode_q, k_cache, v_cache, group, scale))
        for chunk in metadata.prefills:
            out[chunk.token_start:chunk.token_end] = prefill_attention(q, k, v, k_cache, v_cache, chunk, scale)
        return out

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup, scale) -> torch.Tensor:
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        # Query heads of one kv group ride in SDPA's query-length axis, so GQA needs no expanded
        # K/V copy: (D, num_kv_heads, group, head_dim) against (D, num_kv_heads, context, head_dim).
        # Query head h uses kv head h // group, as transformers' repeat_kv does.
        grouped_q = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        # (D, max_blocks * block_size, num_kv_heads, head_dim) -> heads before positions
        block_ids = group.block_ids
        keys, values = self._gather_buffers((block_ids.shape[0], *k_cache.shape[1:]), k_cache)
        torch.index_select(k_cache, 0, block_ids, out=keys)
        torch.index_select(v_cache, 0, block_ids, out=values)
        keys = keys.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=group.mask, scale=scale)
        return out.reshape(num_decodes, num_heads, head_dim)


def prefill_chunks(layout: StepLayout, device: torch.device) -> list[PrefillChunk]:
    """A PrefillChunk for every sequence of the step with more than one query token."""
    return [prefill_chunk(layout, int(row), device) for row in np.flatnonzero(layout.query_lens > 1)]


def prefill_chunk(layout: StepLayout, row: int, device: torch.device) -> PrefillChunk:
    """The chunk of sequence `row` (more than one query token) of a step."""
    token_start, token_end = int(layout.query_starts[row]), int(layout.query_starts[row + 1])
    start, context_len = int(layout.start_positions[row]), int(layout.context_lens[row])
    if start == 0:
        return PrefillChunk(token_start, token_end, context_len, None, None)
    block_ids = np.ascontiguousarray(layout.block_tables[row, : -(-context_len // layout.block_size)])
    query_positions = np.arange(start, context_len)
    mask = np.arange(context_len)[None, :] <= query_positions[:, None]  # (query_len, context_len)
    return PrefillChunk(token_start, token_end, context_len, torch.from_numpy(block_ids).to(device),
                        torch.from_numpy(mask).to(device))


def prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale) -> torch.Tensor:
    """Attention of one prefill chunk's queries: (query_len, num_heads, head_dim)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    query_len = chunk.token_end - chunk.token_start
    if chunk.context_block_ids is None:
        keys = k[chunk.token_start:chunk.token_end]  # (context_len, num_kv_heads, head_dim)
        values = v[chunk.token_start:chunk.token_end]
    else:
        keys = k_cache.index_select(0, chunk.context_block_ids).view(-1, num_kv_heads, head_dim)[:chunk.context_len]
        values = v_cache.index_select(0, chunk.context_block_ids).view(-1, num_kv_heads, head_dim)[:chunk.context_len]
    # GQA as a (num_kv_heads, group) batch with K/V expanded along group as a stride-0 view:
    # CPU SDPA then takes its flash kernel, about twice as fast as enable_gqa's math path.
    # Query head h uses kv head h // group, as transformers' repeat_kv does.
    query = q[chunk.token_start:chunk.token_end].view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    shape = (num_kv_heads, group, chunk.context_len, head_dim)
    keys = keys.transpose(0, 1).unsqueeze(1).expand(shape)
    values = values.transpose(0, 1).unsqueeze(1).expand(shape)
    if chunk.mask is None:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)
