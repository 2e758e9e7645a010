"""Attention over the paged KV cache: a small backend interface, a torch backend and flash-attn.

The cache of one layer is two tensors (num_kv_blocks, block_size, num_kv_heads, head_dim). A
token at position p of a sequence lives in slot block_table[p // block_size] * block_size +
p % block_size of the flattened (num_slots, num_kv_heads, head_dim) view.

Every backend first writes ALL new K/V of the step into the cache, then attends: a sequence may
read a prefix-cache block that another sequence of the same step is writing. Metadata is built
once per step by `prepare` and shared by every layer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION_BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")


@dataclass(slots=True)
class StepLayout:
    """Where each sequence's tokens sit in the packed step, as numpy arrays built by the runner."""

    query_lens: np.ndarray  # (S,) int64: tokens computed this step per sequence
    start_positions: np.ndarray  # (S,) int64: tokens already in the cache before the step
    context_lens: np.ndarray  # (S,) int64: start_positions + query_lens
    query_starts: np.ndarray  # (S + 1,) int64: offsets of each sequence in the packed tokens
    block_tables: np.ndarray  # (S, max_blocks) int64, right-padded with block 0
    slot_mapping: np.ndarray  # (T,) int64: cache slot of every new token
    block_size: int

    def slots_for_positions(self, rows: np.ndarray, max_len: int) -> np.ndarray:
        """(len(rows), max_len) slots of positions [0, max_len) of the given sequences.

        Positions past a sequence's context map through padded block-table entries (block 0);
        callers mask them out.
        """
        positions = np.arange(max_len, dtype=np.int64)
        blocks = self.block_tables[rows][:, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def prepare(self, layout: StepLayout, device: torch.device) -> Any:
        """Build this step's metadata (tensors on `device`), shared by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: Any, scale: float) -> torch.Tensor:
        """q (T, num_heads, head_dim); k, v (T, num_kv_heads, head_dim) -> (T, num_heads, head_dim)."""


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


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
        prefills = [self._prefill_chunk(layout, row, device) for row in np.flatnonzero(query_lens > 1)]
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

    @staticmethod
    def _prefill_chunk(layout: StepLayout, row: int, device: torch.device) -> PrefillChunk:
        token_start, token_end = int(layout.query_starts[row]), int(layout.query_starts[row + 1])
        start, context_len = int(layout.start_positions[row]), int(layout.context_lens[row])
        if start == 0:
            return PrefillChunk(token_start, token_end, context_len, None, None)
        block_ids = np.ascontiguousarray(layout.block_tables[row, : -(-context_len // layout.block_size)])
        query_positions = np.arange(start, context_len)
        mask = np.arange(context_len)[None, :] <= query_positions[:, None]  # (query_len, context_len)
        return PrefillChunk(token_start, token_end, context_len, torch.from_numpy(block_ids).to(device),
                            torch.from_numpy(mask).to(device))

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale):
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        for group in metadata.decode_groups:
            decode_q = q.index_select(0, group.token_indices)
            out.index_copy_(0, group.token_indices, self._decode(decode_q, k_cache, v_cache, group, scale))
        for chunk in metadata.prefills:
            out[chunk.token_start:chunk.token_end] = self._prefill(q, k, v, k_cache, v_cache, chunk, scale)
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

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale) -> torch.Tensor:
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


@dataclass(slots=True)
class FlashAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,)
    cu_seqlens_q: torch.Tensor  # (S + 1,) int32
    cu_seqlens_k: torch.Tensor  # (S + 1,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    # Paged path (block_size a multiple of 256): (S, max_blocks) int32. Otherwise None and
    # context_slots (sum of context_lens,) gathers every sequence's K/V into varlen form.
    block_table: torch.Tensor | None
    context_slots: torch.Tensor | None


class FlashAttentionBackend(AttentionBackend):
    """flash_attn_varlen_func over the whole packed step in one call (CUDA only)."""

    name = "flash_attn"
    # flash-attn reads a paged cache directly only when its page size is a multiple of 256.
    PAGED_BLOCK_MULTIPLE = 256

    def __init__(self, device: torch.device | None = None) -> None:
        from flash_attn import flash_attn_varlen_func

        from model_worker.runner.uploader import Uploader

        self._varlen = flash_attn_varlen_func
        self.upload = Uploader(device or torch.device("cuda"))

    def prepare(self, layout: StepLayout, device: torch.device) -> FlashAttentionMetadata:
        cu_k = np.zeros(len(layout.context_lens) + 1, dtype=np.int64)
        np.cumsum(layout.context_lens, out=cu_k[1:])
        paged = layout.block_size % self.PAGED_BLOCK_MULTIPLE == 0
        if paged:
            context = layout.block_tables
        else:
            max_context = int(layout.context_lens.max())
            slots = layout.slots_for_positions(np.arange(len(layout.context_lens)), max_context)
            valid = np.arange(max_context)[None, :] < layout.context_lens[:, None]
            context = slots[valid]  # row-major: sequence by sequence
        # One asynchronous copy for the whole step; flash-attn takes int32 offsets and tables.
        slot_mapping, cu_q, cu_k_tensor, context = self.upload([layout.slot_mapping, layout.query_starts, cu_k, context])
        return FlashAttentionMetadata(
            slot_mapping=slot_mapping, cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k_tensor.to(torch.int32),
            max_seqlen_q=int(layout.query_lens.max()), max_seqlen_k=int(layout.context_lens.max()),
            block_table=context.to(torch.int32) if paged else None, context_slots=None if paged else context)

    def forward(self, q, k, v, k_cache, v_cache, metadata: FlashAttentionMetadata, scale):
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if metadata.block_table is not None:
            keys, values = k_cache, v_cache
        else:
            num_kv_heads, head_dim = k_cache.shape[-2:]
            keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, metadata.context_slots)
            values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, metadata.context_slots)
        # causal=True is bottom-right aligned in flash-attn >= 2.1: query i of a chunk starting at
        # position p sees keys [0, p + i], which is exactly chunked prefill with earlier context.
        paged = {} if metadata.block_table is None else {"block_table": metadata.block_table}
        return self._varlen(q.contiguous(), keys, values, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                            metadata.max_seqlen_q, metadata.max_seqlen_k, softmax_scale=scale, causal=True, **paged)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


# flash-attn kernels exist for half precision only.
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                             block_size: int) -> AttentionBackend:
    """"auto" on CUDA: flash-attn where it reads the paged cache in place (half precision, a block
    size that is a multiple of 256), else our Triton kernels, else flash-attn gathering K/V, else
    torch. On CPU: torch (Triton runs on CPU only under its interpreter, for tests)."""
    from model_worker.runner import triton_attention

    if name not in ATTENTION_BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_NAMES)}; got {name!r}")
    if name == "auto":
        flash = device.type == "cuda" and dtype in FLASH_ATTN_DTYPES and flash_attn_available()
        if flash and block_size % FlashAttentionBackend.PAGED_BLOCK_MULTIPLE == 0:
            name = "flash_attn"
        elif device.type == "cuda" and triton_attention.triton_available():
            name = "triton"
        else:
            name = "flash_attn" if flash else "torch"
    if name == "triton":
        return triton_attention.TritonAttentionBackend(device)
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flash_attn' needs a CUDA device")
        if dtype not in FLASH_ATTN_DTYPES:
            raise ValueError(f"attention_backend 'flash_attn' needs float16 or bfloat16, not {dtype}")
        if not flash_attn_available():
            raise ValueError("attention_backend 'flash_attn' needs the flash-attn package (pip install flash-attn)")
        return FlashAttentionBackend(device)
    return TorchAttentionBackend()
