"""The Triton backend: our paged-attention kernels (triton_kernels.py), which read K/V in place
from the paged cache for any block size.

`prepare` uploads the step's layout in one copy and cuts the query tokens into the kernels'
tiles: one token per decode tile, PREFILL_BLOCK_Q per prefill tile, each kind one launch.
"""

from __future__ import annotations

import numpy as np
import torch

from model_worker.runner.attention.base import AttentionBackend, StepLayout
from model_worker.runner.attention.triton_kernels import (PREFILL_BLOCK_Q, TileLaunch, TritonAttentionMetadata,
                                                          interpreting, paged_attention, triton_available,
                                                          write_kv_triton)
from model_worker.runner.uploader import Uploader


def build_tiles(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first token) of every tile of block_q query tokens, over the given sequences."""
    tiles_per_seq = -(-query_lens // block_q)
    seqs = np.repeat(np.arange(len(query_lens)), tiles_per_seq)
    first_tile = np.cumsum(tiles_per_seq) - tiles_per_seq
    offsets = (np.arange(len(seqs)) - np.repeat(first_tile, tiles_per_seq)) * block_q
    return seqs, offsets.astype(np.int64)


class TritonAttentionBackend(AttentionBackend):
    """Our paged-attention kernels: CUDA, or CPU under TRITON_INTERPRET=1 (tests)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if not triton_available():
            raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not interpreting():
            raise ValueError("attention_backend 'triton' needs a CUDA device "
                             "(or TRITON_INTERPRET=1 on CPU, which is for tests: it is very slow)")
        self.upload = Uploader(device)

    def prepare(self, layout: StepLayout, device: torch.device) -> TritonAttentionMetadata:
        query_lens = layout.query_lens
        decode_rows = np.flatnonzero(query_lens == 1)
        prefill_rows = np.flatnonzero(query_lens > 1)
        prefill_seqs, prefill_offsets = build_tiles(query_lens[prefill_rows], PREFILL_BLOCK_Q)
        (slot_mapping, block_tables, query_starts, start_positions, context_lens, decode_seqs, prefill_seqs,
         prefill_offsets) = self.upload([layout.slot_mapping, layout.block_tables, layout.query_starts,
                                         layout.start_positions, layout.context_lens, decode_rows,
                                         prefill_rows[prefill_seqs], prefill_offsets])
        launches = []
        if len(decode_rows):
            launches.append(TileLaunch(decode_seqs, torch.zeros_like(decode_seqs), 1))
        if len(prefill_rows):
            launches.append(TileLaunch(prefill_seqs, prefill_offsets, PREFILL_BLOCK_Q))
        return TritonAttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                       query_starts=query_starts, start_positions=start_positions,
                                       context_lens=context_lens, launches=launches)

    def forward(self, q, k, v, k_cache, v_cache, metadata: TritonAttentionMetadata, scale):
        write_kv_triton(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        for launch in metadata.launches:
            paged_attention(out, q, k_cache, v_cache, metadata, launch, scale)
        return out
