"""The flash-attn backend: flash_attn_varlen_func over the whole packed step (CUDA only).

flash-attn reads a paged cache in place only when a block holds a multiple of 256 tokens; for
other block sizes every sequence's context is gathered into varlen form first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_worker.runner.attention.base import AttentionBackend, StepLayout, write_kv


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
