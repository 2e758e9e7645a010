"""The attention backend interface over the paged KV cache, and what every backend shares.

The cache of one layer is two tensors (num_kv_blocks, block_size, num_kv_heads, head_dim). A
token at position p of a sequence lives in slot block_table[p // block_size] * block_size +
p % block_size of the flattened (num_slots, num_kv_heads, head_dim) view.

Every backend first writes ALL new K/V of the step into the cache, then attends: a sequence may
read a prefix-cache block that another sequence of the same step is writing. Metadata is built
once per step by `prepare` and shared by every layer.

This module imports no backend: the backends import it, and selector.py chooses among them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


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
    # Whether forward_qkv is implemented: the rotary embedding, the cache write and attention in
    # one call on the raw q/k/v projection (the CPU backend's kernels).
    fuses_rotary: bool = False

    @abstractmethod
    def prepare(self, layout: StepLayout, device: torch.device) -> Any:
        """Build this step's metadata (tensors on `device`), shared by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: Any, scale: float) -> torch.Tensor:
        """q (T, num_heads, head_dim); k, v (T, num_kv_heads, head_dim) -> (T, num_heads, head_dim)."""

    def forward_qkv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: Any,
                    scale: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv (T, (num_heads + 2 * num_kv_heads) * head_dim), q and k not yet rotated; cos, sin
        (max_len, head_dim) float32 -> (T, num_heads, head_dim). Only where fuses_rotary is True."""
        raise NotImplementedError(f"the {self.name} backend does not fuse the rotary embedding")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
