"""The CPU backend: attention by our kernels over the paged cache in place.

A decode row (one query token) is computed by `decode_attention` (model_worker/runner/cpu_kernels/),
which reads each sequence's K/V blocks where they lie: no gathered copy of the context per layer,
no padding to the longest context of a group, one call per layer for every decode row of the step.
Prompt chunks are computed by `prefill_attention`, one call per layer for every chunk of the step,
also reading the cache through the block tables; it is about twice as fast as torch's flash SDPA
on SmolLM2's heads (docs/benchmarks.md, ninth pass). Where that kernel has no fast path (a CPU
without AVX-512, a head size other than 16, 32, 64 or 128) the chunks run as in the torch
backend: one SDPA each. The kernels are built for this CPU on first use; where they cannot be, the
selector keeps the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_worker.runner.attention.base import AttentionBackend, StepLayout, write_kv
from model_worker.runner.attention.torch_backend import PrefillChunk, prefill_attention, prefill_chunks
from model_worker.runner.cpu_kernels import ops


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,)
    tokens: ops.TokenSlots  # each token's position and slot, for forward_qkv
    decode: ops.DecodeRows
    prefill: ops.PrefillRows  # the step's prompt chunks, for prefill_attention
    layout: StepLayout
    # The same chunks for SDPA, made on the first layer whose chunks prefill_attention declines.
    sdpa_chunks: list[PrefillChunk] | None = None


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    fuses_rotary = True

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        return ops.supports(dtype) and ops.kernels() is not None

    def prepare(self, layout: StepLayout, device: torch.device) -> CpuAttentionMetadata:
        rows = np.flatnonzero(layout.query_lens == 1)
        decode = ops.DecodeRows.of(layout.query_starts[rows], layout.block_tables[rows], layout.context_lens[rows],
                                   layout.block_size)
        chunks = np.flatnonzero(layout.query_lens > 1)
        prefill = ops.PrefillRows.of(layout.query_starts[chunks], layout.query_lens[chunks],
                                     layout.start_positions[chunks], layout.block_tables[chunks], layout.block_size)
        # Token t of sequence s sits at position start_positions[s] + (t - query_starts[s]).
        offsets = np.repeat(layout.query_starts[:-1] - layout.start_positions, layout.query_lens)
        positions = np.arange(len(offsets), dtype=np.int64) - offsets
        return CpuAttentionMetadata(slot_mapping=torch.from_numpy(layout.slot_mapping),
                                    tokens=ops.TokenSlots.of(positions, layout.slot_mapping),
                                    decode=decode, prefill=prefill, layout=layout)

    def forward(self, q, k, v, k_cache, v_cache, metadata: CpuAttentionMetadata, scale):
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self._attend(q, k, v, k_cache, v_cache, metadata, scale)

    def forward_qkv(self, qkv, k_cache, v_cache, metadata: CpuAttentionMetadata, scale, cos, sin):
        num_tokens = qkv.shape[0]
        num_kv_heads, head_dim = k_cache.shape[2:]
        num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
        ops.rotary_and_cache(qkv, metadata.tokens, cos, sin, k_cache, v_cache, num_heads)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
        return self._attend(q, k, v, k_cache, v_cache, metadata, scale)

    @staticmethod
    def _attend(q, k, v, k_cache, v_cache, metadata: CpuAttentionMetadata, scale) -> torch.Tensor:
        """Attention over K/V already in the cache (and in k, v for a prompt's first chunk)."""
        out = torch.empty(q.shape, dtype=q.dtype)
        ops.decode_attention(q, k_cache, v_cache, metadata.decode, out, scale)
        if not ops.prefill_attention(q, k_cache, v_cache, metadata.prefill, out, scale):
            if metadata.sdpa_chunks is None:
                metadata.sdpa_chunks = prefill_chunks(metadata.layout, q.device)
            for chunk in metadata.sdpa_chunks:
                out[chunk.token_start:chunk.token_end] = prefill_attention(q, k, v, k_cache, v_cache, chunk, scale)
        return out
