"""Paged attention in Triton: K/V read in place from the paged cache through the block table.

The torch backend gathers every sequence's context blocks into a contiguous buffer each layer,
and flash-attn reads a paged cache directly only when a block holds a multiple of 256 tokens, so
with the default of 16 it gathers too: decode, which should read each KV byte once, moves it
three times. These kernels read each key and value where it lies, for any block size:
position p of a sequence is row p % block_size of block block_table[p // block_size].

One kernel serves decode and prefill chunks over a paged context. A program takes one tile of a
sequence's query tokens and one KV head; its rows are (token, query head of that KV head) pairs,
so the KV heads' query groups (GQA) share every K/V load. It walks the keys the tile may see
(causal: position <= the query's) in tiles of BLOCK_N with an online softmax in float32. Decode
tokens and prefill chunks run as two launches with their own tile shapes: one query token a
decode tile, BLOCK_Q tokens a prefill tile.

Everything a launch reads is a tensor (no per-step Python ints in the grid but the tile count),
so a decode launch over fixed-size buffers can be captured in a CUDA graph
(model_worker/runner/cuda_graphs.py). Sequences padded in for a graph have context length 0 and
write no K/V (slot -1).

On CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported): that is how CI checks them against the torch backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the other backends need no Triton; TritonAttentionBackend says what is missing
    triton = None

# Query tokens per prefill tile and keys per inner step. Rows of a prefill tile are
# PREFILL_BLOCK_Q * group (padded to a power of two), so a GQA group of 4 gives 64-row tiles.
PREFILL_BLOCK_Q = 16
BLOCK_N = 64
# tl.dot needs every dimension >= 16.
_MIN_DOT = 16


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         stride_k_t, stride_v_t, stride_kc_slot, stride_vc_slot,
                         ROW: tl.constexpr, ROW_PADDED: tl.constexpr):
        """One program per new token: its K and V rows (num_kv_heads * head_dim, contiguous) into
        its cache slot; slot -1 (a padded token) writes nothing."""
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            cols = tl.arange(0, ROW_PADDED)
            mask = cols < ROW
            k = tl.load(k_ptr + token * stride_k_t + cols, mask=mask)
            v = tl.load(v_ptr + token * stride_v_t + cols, mask=mask)
            tl.store(k_cache_ptr + slot * stride_kc_slot + cols, k, mask=mask)
            tl.store(v_cache_ptr + slot * stride_vc_slot + cols, v, mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, query_starts_ptr, start_positions_ptr, context_lens_ptr,
        tile_seqs_ptr, tile_offsets_ptr, scale,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h,
        stride_kc_block, stride_kc_row, stride_kc_head,
        stride_vc_block, stride_vc_row, stride_vc_head,
        stride_bt,
        CACHE_BLOCK: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seqs_ptr + tile)
        tile_offset = tl.load(tile_offsets_ptr + tile)  # first query token of the tile, within the sequence
        query_start = tl.load(query_starts_ptr + seq)
        query_len = tl.load(query_starts_ptr + seq + 1) - query_start
        start_position = tl.load(start_positions_ptr + seq)
        context_len = tl.load(context_lens_ptr + seq)

        rows = tl.arange(0, BLOCK_M)
        token = tile_offset + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (token < query_len)
        query_position = start_position + token
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM

        q = tl.load(q_ptr + (query_start + token)[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

        # Keys this tile can see: up to its last query token's position, within the context.
        kv_end = tl.minimum(context_len, start_position + tile_offset + BLOCK_Q)
        for key_start in range(0, kv_end, BLOCK_N):
            positions = key_start + tl.arange(0, BLOCK_N)
            key_valid = positions < kv_end
            blocks = tl.load(block_tables_ptr + seq * stride_bt + positions // CACHE_BLOCK, mask=key_valid,
                             other=0).to(tl.int64)  # block * stride can pass 2**31 in a large cache
            rows_in_block = positions % CACHE_BLOCK
            k_offsets = blocks * stride_kc_block + rows_in_block * stride_kc_row + kv_head * stride_kc_head
            k = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None],
                        mask=key_valid[None, :] & dim_valid[:, None], other=0.0)  # (HEAD_DIM, BLOCK_N)
            if FP32_DOT:
                scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
            else:
                scores = tl.dot(q, k)
            scores = scores * scale
            visible = key_valid[None, :] & (positions[None, :] <= query_position[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # A row that has seen no visible key yet keeps max -inf; shift it by 0 instead, so
            # exp gives 0, never exp(-inf - -inf) = NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - shift[:, None])
            correction = tl.exp(row_max - shift)
            row_sum = row_sum * correction + tl.sum(probs, 1)
            v_offsets = blocks * stride_vc_block + rows_in_block * stride_vc_row + kv_head * stride_vc_head
            v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :],
                        mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # (BLOCK_N, HEAD_DIM)
            if FP32_DOT:
                acc = acc * correction[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
            row_max = new_max

        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + (query_start + token)[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@dataclass(slots=True)
class TileLaunch:
    """One kernel launch: (sequence, first query token) per program, and the tile's shape."""

    tile_seqs: torch.Tensor  # (tiles,) int64
    tile_offsets: torch.Tensor  # (tiles,) int64
    block_q: int


@dataclass(slots=True)
class TritonAttentionMetadata:
    """Every field int64 on the device."""

    slot_mapping: torch.Tensor  # (T,), -1 for tokens that write no K/V
    block_tables: torch.Tensor  # (S, max_blocks)
    query_starts: torch.Tensor  # (S + 1,)
    start_positions: torch.Tensor  # (S,)
    context_lens: torch.Tensor  # (S,)
    launches: list[TileLaunch]


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v (T, num_kv_heads, head_dim) into the cache slots; slot -1 is skipped."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    row = num_kv_heads * head_dim
    k, v = k.reshape(num_tokens, row), v.reshape(num_tokens, row)  # heads are contiguous after the qkv split
    if k.stride(1) != 1 or v.stride(1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _write_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    k_cache.stride(1), v_cache.stride(1), ROW=row, ROW_PADDED=_next_pow2(row))


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: TritonAttentionMetadata, launch: TileLaunch, scale: float) -> None:
    num_tiles = launch.tile_seqs.shape[0]
    if num_tiles == 0:
        return
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    block_m = max(_MIN_DOT, _next_pow2(launch.block_q * group))
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        out, q, k_cache, v_cache, metadata.block_tables, metadata.query_starts, metadata.start_positions,
        metadata.context_lens, launch.tile_seqs, launch.tile_offsets, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        metadata.block_tables.stride(0),
        CACHE_BLOCK=block_size, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(_MIN_DOT, _next_pow2(head_dim)),
        BLOCK_Q=launch.block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        # float32 models get exact float32 products (tl.dot would take TF32), and so does the
        # interpreter, whose bfloat16 dot is wrong (Triton 3.9); bfloat16 on a GPU takes the
        # tensor cores, with the probabilities rounded to bfloat16 for P @ V as flash-attn does.
        FP32_DOT=q.dtype == torch.float32 or interpreting())
