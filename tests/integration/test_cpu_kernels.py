"""Our CPU kernels (model_worker/runner/cpu_kernels/) against torch computing the same thing.

Each kernel is checked on shapes that take its vectorised path and its generic one (head sizes
that are not a multiple of 16, group sizes without a specialised variant, tails shorter than a
vector), in float32 (to float32 rounding) and bfloat16 (to bfloat16 rounding of the result).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_worker.runner.attention.base import StepLayout, write_kv
from model_worker.runner.attention.cpu_backend import CpuAttentionBackend
from model_worker.runner.attention.torch_backend import TorchAttentionBackend
from model_worker.runner.cpu_kernels import build, ops

pytestmark = pytest.mark.skipif(ops.kernels() is None, reason="the CPU kernels do not build here (no C++ compiler)")

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def paged_decode_case(num_rows: int, context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype: torch.dtype, seed: int = 0):
    """Caches with every row's blocks scattered in a random order, and one query token per row."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_row) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = np.zeros((num_rows, max(blocks_per_row)), dtype=np.int64)
    for row, count in enumerate(blocks_per_row):
        tables[row, :count] = [order.pop() for _ in range(count)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(num_rows, num_heads, head_dim, generator=generator).to(dtype)
    lens = np.array(context_lens, dtype=np.int64)
    layout = StepLayout(query_lens=np.ones(num_rows, dtype=np.int64), start_positions=lens - 1, context_lens=lens,
                        query_starts=np.arange(num_rows + 1, dtype=np.int64), block_tables=tables,
                        slot_mapping=np.zeros(num_rows, dtype=np.int64), block_size=block_size)
    return q, k_cache, v_cache, layout


def torch_decode(q, k_cache, v_cache, layout, scale):
    backend = TorchAttentionBackend()
    metadata = backend.prepare(layout, torch.device("cpu"))
    out = torch.empty_like(q)
    for group in metadata.decode_groups:
        out.index_copy_(0, group.token_indices,
                        backend._decode(q.index_select(0, group.token_indices), k_cache, v_cache, group, scale))
    return out


@pytest.mark.parametrize("dtype, atol", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, context_lens", [
    (9, 3, 64, [1, 17, 200, 31]),  # SmolLM2's heads: the register-resident variant
    (9, 3, 64, [700, 5, 513]),  # contexts split into parts and merged
    (8, 2, 128, [40, 300]),  # Llama-3's head size
    (10, 2, 64, [33, 260]),  # a group of 5: the generic path
    (4, 4, 24, [3, 90, 600]),  # head_dim not a multiple of 16: the generic path
])
def test_decode_attention_matches_torch(dtype, atol, num_heads, num_kv_heads, head_dim, context_lens):
    q, k_cache, v_cache, layout = paged_decode_case(len(context_lens), context_lens, num_heads, num_kv_heads,
                                                    head_dim, 16, dtype)
    rows = ops.DecodeRows.of(layout.query_starts[:-1], layout.block_tables, layout.context_lens, 16)
    out = torch.empty_like(q)
    ops.decode_attention(q, k_cache, v_cache, rows, out, head_dim ** -0.5)
    expected = torch_decode(q, k_cache, v_cache, layout, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype, atol", DTYPES)
@pytest.mark.parametrize("block_size", [16, 12, 128])
def test_decode_attention_of_a_large_batch_matches_torch_at_any_block_size(dtype, atol, block_size):
    """Enough parts a thread that each is loaded into L2 before it is computed (the burst's steps),
    over blocks that a 16-position tile does not divide (12) or that hold many tiles (128)."""
    context_lens = [290] * 16 + [1, 700, 47]
    q, k_cache, v_cache, layout = paged_decode_case(len(context_lens), context_lens, 9, 3, 64, block_size, dtype)
    rows = ops.DecodeRows.of(layout.query_starts[:-1], layout.block_tables, layout.context_lens, block_size)
    out = torch.empty_like(q)
    ops.decode_attention(q, k_cache, v_cache, rows, out, 64 ** -0.5)
    expected = torch_decode(q, k_cache, v_cache, layout, 64 ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


def test_decode_attention_reads_q_rows_through_their_stride_and_writes_only_its_rows():
    """q may be a view into the q/k/v projection, and rows not listed stay as they were."""
    q, k_cache, v_cache, layout = paged_decode_case(2, [20, 40], 9, 3, 64, 16, torch.float32)
    qkv = torch.randn(3, 15, 64)
    qkv[[0, 2], :9] = q
    rows = ops.DecodeRows.of(np.array([0, 2]), layout.block_tables, layout.context_lens, 16)
    out = torch.full((3, 9, 64), 7.0)
    ops.decode_attention(qkv[:, :9], k_cache, v_cache, rows, out, 0.125)
    torch.testing.assert_close(out[[0, 2]], torch_decode(q, k_cache, v_cache, layout, 0.125), atol=1e-5, rtol=0)
    assert torch.all(out[1] == 7.0)


def test_decode_attention_refuses_indices_out_of_range():
    q, k_cache, v_cache, layout = paged_decode_case(2, [20, 40], 9, 3, 64, 16, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="negative"):
        ops.DecodeRows.of(np.array([0, -1]), layout.block_tables, layout.context_lens, 16)
    with pytest.raises(ValueError, match="context length"):
        ops.DecodeRows.of(np.array([0, 1]), layout.block_tables, np.array([20, 4000]), 16)
    tables = layout.block_tables.copy()
    tables[1, 0] = k_cache.shape[0]  # one past the last block
    rows = ops.DecodeRows.of(np.array([0, 1]), tables, layout.context_lens, 16)
    with pytest.raises(ValueError, match="out of range"):
        ops.decode_attention(q, k_cache, v_cache, rows, out, 0.125)
    rows = ops.DecodeRows.of(np.array([0, 5]), layout.block_tables, layout.context_lens, 16)
    with pytest.raises(ValueError, match="out of range"):
        ops.decode_attention(q, k_cache, v_cache, rows, out, 0.125)
    rows = ops.DecodeRows.of(np.array([0, 1]), layout.block_tables, layout.context_lens, 16)
    with pytest.raises(ValueError, match="dtypes"):
        ops.decode_attention(q.bfloat16(), k_cache, v_cache, rows, out, 0.125)


def paged_prefill_case(chunks: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int, dtype: torch.dtype, seed: int = 0):
    """Prompt chunks (start position, query tokens) of sequences whose blocks lie in a random order,
    every position up to each chunk's end already in the caches, the chunks' queries packed one
    after another."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(start + length) // block_size) for start, length in chunks]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = np.full((len(chunks), max(blocks_per_seq) + 1), -1, dtype=np.int64)  # padded, as the engine's are
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = [order.pop() for _ in range(count)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    lens = np.array([length for _, length in chunks], dtype=np.int64)
    q = torch.randn(int(lens.sum()), num_heads, head_dim, generator=generator).to(dtype)
    rows = ops.PrefillRows.of(np.concatenate([[0], np.cumsum(lens)[:-1]]), lens,
                              np.array([start for start, _ in chunks]), tables, block_size)
    return q, k_cache, v_cache, rows, tables


def sdpa_prefill(q, k_cache, v_cache, chunks, tables, scale):
    """Each chunk by SDPA over its sequence's gathered context, masked causally from its start."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    outs, token = [], 0
    for seq, (start, length) in enumerate(chunks):
        positions = torch.arange(start + length)
        slots = torch.from_numpy(tables[seq])[positions // block_size] * block_size + positions % block_size
        k, v = (cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1).transpose(0, 1)
                for cache in (k_cache, v_cache))
        mask = positions[None, :] <= (start + torch.arange(length))[:, None]
        outs.append(F.scaled_dot_product_attention(q[token:token + length].double().transpose(0, 1), k, v,
                                                   attn_mask=mask, scale=scale).transpose(0, 1))
        token += length
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, chunks", [
    (9, 3, 64, [(0, 256)]),  # SmolLM2's heads, one whole prompt
    (9, 3, 64, [(0, 37), (300, 200), (16, 5)]),  # chunks that continue a sequence, past a 256-key chunk
    (4, 2, 16, [(7, 70), (0, 2)]),  # positions that do not start a block
    (8, 8, 32, [(0, 600)]),  # no grouping; three chunks of keys
    (4, 1, 128, [(100, 33)]),  # Llama-3's head size, one kv head
])
def test_prefill_attention_matches_sdpa_over_the_paged_cache(dtype, atol, num_heads, num_kv_heads, head_dim,
                                                             chunks):
    q, k_cache, v_cache, rows, tables = paged_prefill_case(chunks, num_heads, num_kv_heads, head_dim, 16, dtype)
    if not ops.prefill_attention(q, k_cache, v_cache, rows, out := torch.empty_like(q), head_dim ** -0.5):
        pytest.skip("prefill_attention's fast path needs AVX-512")
    expected = sdpa_prefill(q, k_cache, v_cache, chunks, tables, head_dim ** -0.5)
    # float32: the order of the sums; bfloat16: the inputs are exact, one rounding of the result.
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=atol, rtol=0)


def bf16_error(out: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Max and root-mean-square error of a bfloat16 result against a float64 one."""
    diff = out.double() - expected
    return diff.abs().max().item(), diff.pow(2).mean().sqrt().item()


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, chunks", [
    (9, 3, 64, [(0, 256)]),
    (9, 3, 64, [(0, 37), (300, 200), (16, 5)]),
    (8, 2, 128, [(0, 300)]),
])
def test_bf16_attention_is_as_accurate_as_torch_bf16_sdpa(num_heads, num_kv_heads, head_dim, chunks):
    """In bfloat16 the scores may be summed on bfloat16 pairs (dpbf16ps: exact products, float32
    sums, the scale applied after): prompt and decode attention stay within the error of torch's
    own bfloat16 SDPA against float64."""
    scale = head_dim ** -0.5
    q, k_cache, v_cache, rows, tables = paged_prefill_case(chunks, num_heads, num_kv_heads, head_dim, 16,
                                                           torch.bfloat16, seed=3)
    if not ops.prefill_attention(q, k_cache, v_cache, rows, out := torch.empty_like(q), scale):
        pytest.skip("prefill_attention's fast path needs AVX-512")
    expected = sdpa_prefill(q, k_cache, v_cache, chunks, tables, scale)
    group, outs, token = num_heads // num_kv_heads, [], 0
    for seq, (start, length) in enumerate(chunks):  # torch's SDPA in bfloat16, over the same gathered K/V
        positions = torch.arange(start + length)
        slots = torch.from_numpy(tables[seq])[positions // 16] * 16 + positions % 16
        k, v = (cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1) for cache in (k_cache, v_cache))
        mask = positions[None, :] <= (start + torch.arange(length))[:, None]
        outs.append(F.scaled_dot_product_attention(q[token:token + length].transpose(0, 1), k, v, attn_mask=mask,
                                                   scale=scale).transpose(0, 1))
        token += length
    ours, torchs = bf16_error(out, expected), bf16_error(torch.cat(outs), expected)
    assert ours[0] <= torchs[0] * 1.1 and ours[1] <= torchs[1] * 1.1, (ours, torchs)

    context_lens = [start + length for start, length in chunks]
    q, k_cache, v_cache, layout = paged_decode_case(len(chunks), context_lens, num_heads, num_kv_heads, head_dim, 16,
                                                    torch.bfloat16, seed=3)
    decode_rows = ops.DecodeRows.of(layout.query_starts[:-1], layout.block_tables, layout.context_lens, 16)
    ops.decode_attention(q, k_cache, v_cache, decode_rows, out := torch.empty_like(q), scale)
    expected = torch_decode(q.double(), k_cache.double(), v_cache.double(), layout, scale)
    ours, torchs = bf16_error(out, expected), bf16_error(torch_decode(q, k_cache, v_cache, layout, scale), expected)
    assert ours[0] <= torchs[0] * 1.1 and ours[1] <= torchs[1] * 1.1, (ours, torchs)


def test_prefill_attention_reads_and_writes_token_rows_through_their_strides():
    chunks = [(0, 20), (16, 9)]
    q, k_cache, v_cache, rows, tables = paged_prefill_case(chunks, 9, 3, 64, 16, torch.float32)
    qkv = torch.randn(29, 15, 64)
    qkv[:, :9] = q
    out = torch.full((29, 12, 64), 7.0)
    if not ops.prefill_attention(qkv[:, :9], k_cache, v_cache, rows, out[:, 2:11], 0.125):
        pytest.skip("prefill_attention's fast path needs AVX-512")
    torch.testing.assert_close(out[:, 2:11].double(), sdpa_prefill(q, k_cache, v_cache, chunks, tables, 0.125),
                               atol=1e-5, rtol=0)
    assert torch.all(out[:, :2] == 7.0) and torch.all(out[:, 11:] == 7.0)


def test_prefill_attention_declines_head_sizes_without_a_fast_path_and_writes_nothing():
    q, k_cache, v_cache, rows, _ = paged_prefill_case([(0, 40)], 4, 4, 24, 16, torch.float32)
    out = torch.full_like(q, 7.0)
    assert ops.prefill_attention(q, k_cache, v_cache, rows, out, 0.2) is False
    assert torch.all(out == 7.0)


def test_prefill_attention_refuses_indices_out_of_range():
    q, k_cache, v_cache, rows, tables = paged_prefill_case([(0, 20), (16, 9)], 9, 3, 64, 16, torch.float32)
    out = torch.empty_like(q)
    starts, lens = np.array([0, 20]), np.array([20, 9])
    with pytest.raises(ValueError, match="negative"):
        ops.PrefillRows.of(np.array([0, -1]), lens, np.array([0, 16]), tables, 16)
    with pytest.raises(ValueError, match="negative"):
        ops.PrefillRows.of(starts, np.array([20, 0]), np.array([0, 16]), tables, 16)
    with pytest.raises(ValueError, match="context length"):
        ops.PrefillRows.of(starts, lens, np.array([0, 4000]), tables, 16)
    holes = tables.copy()
    holes[1, 0] = -1  # a block the chunk reads that was never given
    with pytest.raises(ValueError, match="negative"):
        ops.PrefillRows.of(starts, lens, np.array([0, 16]), holes, 16)
    beyond = tables.copy()
    beyond[1, 0] = k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="out of range"):
        ops.prefill_attention(q, k_cache, v_cache, ops.PrefillRows.of(starts, lens, np.array([0, 16]), beyond, 16),
                              out, 0.125)
    with pytest.raises(ValueError, match="out of range"):  # more query rows than q holds
        ops.prefill_attention(q, k_cache, v_cache, ops.PrefillRows.of(np.array([0, 21]), lens, np.array([0, 16]),
                                                                      tables, 16), out, 0.125)
    with pytest.raises(ValueError, match="dtypes"):
        ops.prefill_attention(q.bfloat16(), k_cache, v_cache, rows, out, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 576), (300, 576), (3, 33)])
def test_rms_norm_is_transformers_formula(dtype, rows, width):
    x = (torch.randn(rows, width) * 3).to(dtype)
    weight = (torch.rand(width) + 0.5).to(dtype)
    x32 = x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = ops.rms_norm(x, weight, 1e-5)
    if dtype == torch.bfloat16:  # the same roundings: equal but where the float32 mean rounds differently
        assert (got != expected).float().mean() < 0.01
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 1.6e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype, atol", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1536), (70, 1536), (2, 21)])
def test_silu_and_mul_matches_torch(dtype, atol, rows, width):
    x = (torch.randn(rows, 2 * width) * 4).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(ops.silu_and_mul(x).float(), expected, atol=atol, rtol=1e-2 if atol > 1e-4 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_rotates_in_place_and_writes_each_token_to_its_slot(dtype):
    num_heads, num_kv_heads, head_dim, tokens = 6, 2, 32, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = np.array([0, 7, 3, 100, 4])
    slots = np.array([5, 0, 9, 31, 17])
    angles = torch.arange(128).float()[:, None] * torch.rand(head_dim // 2)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    k_cache = torch.zeros(4, 8, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    heads = qkv.float().view(tokens, -1, head_dim)
    qk = heads[:, : num_heads + num_kv_heads]
    half = head_dim // 2
    rotated = qk * cos[positions][:, None] + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin[positions][:, None]
    write_kv(rotated[:, num_heads:].to(dtype), heads[:, num_heads + num_kv_heads:].to(dtype), expected_k_cache,
             expected_v_cache, torch.from_numpy(slots))
    ops.rotary_and_cache(qkv, ops.TokenSlots.of(positions, slots), cos, sin, k_cache, v_cache, num_heads)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(qkv.float().view(tokens, -1, head_dim)[:, : num_heads + num_kv_heads], rotated,
                               atol=atol, rtol=0)
    torch.testing.assert_close(k_cache.float(), expected_k_cache.float(), atol=atol, rtol=0)
    assert torch.equal(v_cache, expected_v_cache)
    with pytest.raises(ValueError, match="out of range"):
        ops.rotary_and_cache(qkv, ops.TokenSlots.of(positions, np.array([5, 0, 9, 32, 17])), cos, sin, k_cache,
                             v_cache, num_heads)
    with pytest.raises(ValueError, match="out of range"):
        ops.rotary_and_cache(qkv, ops.TokenSlots.of(np.array([0, 7, 3, 128, 4]), slots), cos, sin, k_cache,
                             v_cache, num_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [5, 16, 17, 49152, 49157])
def test_argmax_is_torch_argmax_with_its_ties_and_nans(dtype, width):
    x = torch.randn(9, width).to(dtype)
    x[1, width // 2] = float("nan")  # torch picks the first NaN
    x[2, :] = 0.5  # all equal: the first index
    x[3, -1] = 1e9  # the tail past the last full vector
    if width > 10:
        x[4, 3] = x[4, width - 3] = 100.0  # a tie: the first
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _gumbel_scores(x: torch.Tensor, inv_temperatures: torch.Tensor, seeds: torch.Tensor) -> np.ndarray:
    """The scores sample_rows maximises, in float64: x / T - ln(-ln U), U from the hash of (seed, index)."""
    rows, width = x.shape
    index = np.arange(width, dtype=np.uint32)
    scores = np.empty((rows, width))
    with np.errstate(over="ignore"):
        for r in range(rows):
            seed = int(seeds[r]) % 2**64
            lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
            h = _fmix32(_fmix32(index * np.uint32(0x9E3779B9) + lo) ^ hi)
            u = (h >> np.uint32(8)).astype(np.float64) * 2.0**-24 + 2.0**-25
            scores[r] = x[r].double().numpy() * float(inv_temperatures[r]) - np.log(-np.log(u))
    return scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 5, 16, 2048, 2049, 49157])
def test_sample_draws_the_maximum_of_logits_over_temperature_plus_gumbel_noise(dtype, width):
    generator = torch.Generator().manual_seed(width)
    rows = 12
    x = (torch.randn(rows, width, generator=generator) * 4).to(dtype)
    inv_temperatures = torch.tensor([1.0, 2.0, 0.5, 10.0] * 3, dtype=torch.float32)
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 12345] * 2, dtype=torch.int64)
    tokens = ops.sample(x, inv_temperatures, seeds)
    scores = _gumbel_scores(x, inv_temperatures, seeds)
    best = scores.max(axis=1)
    picked = scores[np.arange(rows), tokens.numpy()]
    # The kernel computes in float32: its pick is a maximiser up to float32 rounding of the scores.
    assert np.all(best - picked <= 1e-5 * np.maximum(1.0, np.abs(best))), (best - picked)
    assert torch.equal(ops.sample(x, inv_temperatures, seeds), tokens)  # a seed draws one token
    # A row's token depends on its own logits, temperature and seed alone, not on the rest of the batch.
    for r in (0, 5, 11):
        assert int(ops.sample(x[r:r + 1].contiguous(), inv_temperatures[r:r + 1], seeds[r:r + 1])[0]) == tokens[r]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sample_frequencies_follow_the_softmax_at_the_temperature(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 3.0])
    draws = 40_000
    x = logits.expand(draws, -1).contiguous()
    tokens = ops.sample(x, torch.full((draws,), 1 / temperature), torch.arange(draws, dtype=torch.int64) * 7919 + 3)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * draws
    assert counts[5] == 0  # -inf is never drawn
    # Each count within 5 standard deviations of its binomial expectation.
    sigma = (expected * (1 - expected / draws)).sqrt()
    assert torch.all((counts - expected).abs() <= 5 * sigma + 1e-9), (counts, expected)


def test_sample_gives_a_rows_first_nan_and_refuses_bad_calls():
    x = torch.randn(3, 100)
    x[1, 40] = x[1, 70] = float("nan")
    inv, seeds = torch.ones(3), torch.arange(3, dtype=torch.int64)
    assert int(ops.sample(x, inv, seeds)[1]) == 40
    with pytest.raises(ValueError, match="positive and finite"):
        ops.sample(x, torch.tensor([1.0, 0.0, 1.0]), seeds)
    with pytest.raises(ValueError, match="positive and finite"):
        ops.sample(x, torch.tensor([1.0, float("inf"), 1.0]), seeds)
    with pytest.raises(ValueError, match="temperatures or seeds"):
        ops.sample(x, torch.ones(2), seeds)
    with pytest.raises(ValueError, match="temperatures or seeds"):
        ops.sample(x, inv, seeds.int())
    with pytest.raises(ValueError, match="bad sample argument"):
        ops.sample(x.t(), torch.ones(100), torch.arange(100, dtype=torch.int64))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (9, 3, 64),  # prefill_attention's fast path (on AVX-512)
    (4, 2, 24),  # a head size it declines: SDPA for the chunks
])
def test_cpu_backend_gives_the_torch_backends_attention_on_a_mixed_step(num_heads, num_kv_heads, head_dim):
    """Prefill chunks (one starting its sequence, one continuing it) beside decodes; each backend
    writes the step's K/V into its own copy of the caches first."""
    block_size = 16
    query_lens, start_positions = np.array([1, 20, 1, 7]), np.array([30, 0, 5, 16])
    block_tables = np.array([[3, 4], [5, 6], [7, 0], [8, 9]])
    query_starts = np.concatenate([[0], np.cumsum(query_lens)])
    seq_of_token = np.repeat(np.arange(4), query_lens)
    positions = np.arange(query_starts[-1]) - (query_starts[:-1] - start_positions)[seq_of_token]
    layout = StepLayout(query_lens=query_lens, start_positions=start_positions,
                        context_lens=start_positions + query_lens, query_starts=query_starts,
                        block_tables=block_tables, block_size=block_size,
                        slot_mapping=block_tables[seq_of_token, positions // block_size] * block_size
                        + positions % block_size)
    tokens = int(query_starts[-1])
    q = torch.randn(tokens, num_heads, head_dim)
    k, v = torch.randn(tokens, num_kv_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(10, block_size, num_kv_heads, head_dim), torch.randn(10, block_size, num_kv_heads,
                                                                                         head_dim)
    outs = []
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        metadata = backend.prepare(layout, torch.device("cpu"))
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, 0.125))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_no_compiler_means_no_kernels_and_the_torch_backend(monkeypatch, tmp_path):
    from model_worker.runner.attention.selector import create_attention_backend

    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler"):
        build.library_path(str(tmp_path))
    monkeypatch.setattr(ops, "kernels", lambda: None)
    assert create_attention_backend("auto", torch.device("cpu"), torch.float32, 16).name == "torch"


def test_a_build_lands_by_rename_and_is_reused(tmp_path):
    first = build.library_path(str(tmp_path))
    assert first.is_file() and first.parent.parent == tmp_path / "kernels"
    assert build.library_path(str(tmp_path)) == first
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".build-")] == []


def test_kernels_from_runs_the_ops_on_another_build_inside_the_block_only():
    here = ops.kernels()
    with ops.kernels_from(build.SOURCE.read_bytes()) as other:
        assert ops.kernels() is other and other is not here
        q, k_cache, v_cache, layout = paged_decode_case(2, [20, 40], 9, 3, 64, 16, torch.float32)
        rows = ops.DecodeRows.of(layout.query_starts[:-1], layout.block_tables, layout.context_lens, 16)
        ops.decode_attention(q, k_cache, v_cache, rows, out := torch.empty_like(q), 0.125)
    assert ops.kernels() is here
    torch.testing.assert_close(out, torch_decode(q, k_cache, v_cache, layout, 0.125), atol=1e-5, rtol=0)


@pytest.mark.parametrize("source, reason", [
    (b'extern "C" void nothing() {}\n', "lacks a function"),
    (b"this is not C++\n", "failed"),
])
def test_kernels_from_refuses_a_source_that_does_not_build_or_lacks_a_function(source, reason):
    here = ops.kernels()
    with pytest.raises(build.KernelBuildError, match=reason):
        with ops.kernels_from(source):
            pass
    assert ops.kernels() is here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40, 300, 529])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (16, 100), (80, 30), (80, 64), (49152, 64)])
def test_panel_linear_matches_a_float64_matmul_with_bias_and_residual(dtype, rows, out_features, in_features):
    """Row counts that leave a partial group of eight (and, on AMX, of sixteen) rows, and past one
    block of kPanelRowBlock rows (300, 529: a partial block, a partial group in it), feature counts
    that leave a partial group of three panels (80: on the AVX-512 path and on AMX's), input widths
    that are not a multiple of AMX's 32 (the AVX-512 path then); the sum in float32, rounded once
    to the dtype."""
    if not ops.has_panel_linear(dtype):
        pytest.skip(f"panel_linear does not run {dtype} here (AVX-512 with BW, or AVX2 with FMA for float32)")
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    residual = torch.randn(rows, out_features, generator=generator).to(dtype)
    panels = ops.pack_panels(weight)
    assert ops.panel_shape(panels) == (out_features, in_features)
    exact = x.double() @ weight.double().T
    for args, expected in (((), exact), ((bias,), exact + bias.double()),
                           ((None, residual), exact + residual.double()),
                           ((bias, residual), exact + bias.double() + residual.double())):
        got = ops.panel_linear(x, panels, *args)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        # float32: the order of the sums; bfloat16: one rounding of the result (2^-8 relative).
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 1e-3)
        torch.testing.assert_close(got.double(), expected.to(dtype).double(), rtol=rtol, atol=atol)


def test_pack_panels_lays_out_sixteen_features_a_panel():
    weight = torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4)
    panels = ops.pack_panels(weight)
    assert panels.shape == (2, 4, 16) and torch.equal(panels[1, 2], weight[16:, 2])
    pairs = ops.pack_panels(weight.bfloat16())
    assert pairs.shape == (2, 2, 16, 2) and torch.equal(pairs[1, 1, 3], weight[19, 2:4].bfloat16())
    for bad in (torch.randn(20, 4), torch.randn(16, 3).bfloat16(), torch.randn(16, 4).half(), torch.randn(16)):
        assert not ops.can_pack_panels(bad)
        with pytest.raises(ValueError, match="panels cannot hold"):
            ops.pack_panels(bad)


def test_panel_linear_reads_x_rows_through_their_stride_and_refuses_bad_calls():
    if not ops.has_panel_linear(torch.float32):
        pytest.skip("panel_linear needs AVX-512 with BW, or AVX2 with FMA for float32")
    wide = torch.randn(3, 100)
    x = wide[:, :64]  # rows 100 apart
    weight = torch.randn(32, 64)
    panels = ops.pack_panels(weight)
    torch.testing.assert_close(ops.panel_linear(x, panels), x @ weight.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="arguments"):
        ops.panel_linear(torch.randn(0, 64), panels)  # no rows
    with pytest.raises(ValueError, match="arguments"):
        ops.panel_linear(torch.randn(2, 65), panels)  # widths differ
    with pytest.raises(ValueError, match="arguments"):
        ops.panel_linear(torch.randn(2, 64).bfloat16(), panels)  # dtypes differ
    with pytest.raises(ValueError, match="arguments"):
        ops.panel_linear(torch.randn(2, 64), weight)  # a weight not packed in panels
    with pytest.raises(ValueError, match="arguments"):
        ops.panel_linear(torch.randn(2, 64), panels.transpose(0, 1))  # not contiguous
    with pytest.raises(ValueError, match="residual"):
        ops.panel_linear(torch.randn(2, 64), panels, None, torch.randn(3, 32))
    with pytest.raises(ValueError, match="bias"):
        ops.panel_linear(torch.randn(2, 64), panels, torch.randn(33))


def test_small_layers_refuses_what_would_read_out_of_bounds():
    if not ops.has_panel_linear(torch.float32):
        pytest.skip("panel_linear needs AVX-512 with BW, or AVX2 with FMA for float32")
    hidden, intermediate, num_heads, num_kv_heads, head_dim = 32, 48, 4, 2, 8
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    norm = torch.ones(hidden)
    panels = ops.pack_panels
    parts = dict(input_norm=norm, qkv=panels(torch.randn(qkv_width, hidden)), qkv_bias=None,
                 o=panels(torch.randn(hidden, num_heads * head_dim)), o_bias=None, post_norm=norm,
                 gate_up=panels(torch.randn(2 * intermediate, hidden)), down=panels(torch.randn(hidden, intermediate)))
    layer = ops.SmallLayer.of(**parts)
    with pytest.raises(ValueError, match="shapes"):
        ops.SmallLayer.of(**(parts | {"down": panels(torch.randn(hidden, intermediate + 2))}))
    with pytest.raises(ValueError, match="panels"):
        ops.SmallLayer.of(**(parts | {"down": torch.randn(hidden, intermediate)}))  # a plain matrix
    with pytest.raises(ValueError, match="plain"):
        ops.SmallLayer.of(**(parts | {"qkv": parts["qkv"].bfloat16()}))
    caches = [(torch.zeros(4, 16, num_kv_heads, head_dim), torch.zeros(4, 16, num_kv_heads, head_dim))]
    cos = sin = torch.ones(64, head_dim)
    x = torch.randn(2, hidden)
    rows = ops.DecodeRows.of(np.array([0, 1]), np.array([[0], [1]]), np.array([3, 5]), 16)
    tokens = ops.TokenSlots.of(np.array([2, 4]), np.array([2, 20]))
    out = ops.small_layers(x, [layer], caches, tokens, rows, cos, sin, num_heads, 1e-5, 0.3)
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="decode row"):  # a row of the step that is not a decode row
        ops.small_layers(torch.randn(3, hidden), [layer], caches, ops.TokenSlots.of(np.array([2, 4, 5]),
                         np.array([2, 20, 21])), rows, cos, sin, num_heads, 1e-5, 0.3)
    with pytest.raises(ValueError, match="out of range"):
        ops.small_layers(x, [layer], caches, ops.TokenSlots.of(np.array([2, 4]), np.array([2, 64])), rows, cos,
                         sin, num_heads, 1e-5, 0.3)
    with pytest.raises(ValueError, match="decode row"):
        ops.small_layers(x, [layer], caches, tokens, ops.DecodeRows.of(np.array([0, 1]), np.array([[0], [4]]),
                         np.array([3, 5]), 16), cos, sin, num_heads, 1e-5, 0.3)


def test_small_layers_takes_prompt_chunks_beside_decode_rows_and_refuses_bad_ones():
    if not (ops.has_panel_linear(torch.float32) and ops.prefill_attention_built(16)):
        pytest.skip("panel_linear and prefill_attention need AVX-512")
    hidden, intermediate, num_heads, num_kv_heads, head_dim = 32, 48, 4, 2, 16
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    norm = torch.ones(hidden)
    panels = ops.pack_panels
    layer = ops.SmallLayer.of(norm, panels(torch.randn(qkv_width, hidden)), None,
                              panels(torch.randn(hidden, num_heads * head_dim)), None, norm,
                              panels(torch.randn(2 * intermediate, hidden)), panels(torch.randn(hidden, intermediate)))
    caches = [(torch.zeros(4, 16, num_kv_heads, head_dim), torch.zeros(4, 16, num_kv_heads, head_dim))]
    cos = sin = torch.ones(64, head_dim)
    # Token 0 decodes at position 4 of block 0; tokens 1-3 are a prompt chunk at positions 2-4 of block 1.
    rows = ops.DecodeRows.of(np.array([0]), np.array([[0]]), np.array([5]), 16)
    chunks = ops.PrefillRows.of(np.array([1]), np.array([3]), np.array([2]), np.array([[1]]), 16)
    tokens = ops.TokenSlots.of(np.array([4, 2, 3, 4]), np.array([4, 18, 19, 20]))
    x = torch.randn(4, hidden)
    out = ops.small_layers(x, [layer], caches, tokens, rows, cos, sin, num_heads, 1e-5, 0.3, chunks)
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="decode row or a prompt token"):  # the chunk has 2 tokens, the step 3 more
        ops.small_layers(x, [layer], caches, tokens, rows, cos, sin, num_heads, 1e-5, 0.3,
                         ops.PrefillRows.of(np.array([1]), np.array([2]), np.array([2]), np.array([[1]]), 16))
    with pytest.raises(ValueError, match="prompt chunk out of range"):  # tokens 2-4 of a 4-token step
        ops.small_layers(x, [layer], caches, tokens, ops.DecodeRows.of(np.array([1]), np.array([[0]]), np.array([5]),
                         16), cos, sin, num_heads, 1e-5, 0.3,
                         ops.PrefillRows.of(np.array([2]), np.array([3]), np.array([2]), np.array([[1]]), 16))
    with pytest.raises(ValueError, match="prompt chunk out of range"):  # block 4 of a 4-block cache
        ops.small_layers(x, [layer], caches, tokens, rows, cos, sin, num_heads, 1e-5, 0.3,
                         ops.PrefillRows.of(np.array([1]), np.array([3]), np.array([2]), np.array([[4]]), 16))
    narrow = ops.SmallLayer.of(torch.ones(hidden), panels(torch.randn(64, hidden)), None,
                               panels(torch.randn(hidden, 32)), None, torch.ones(hidden),
                               panels(torch.randn(2 * intermediate, hidden)), panels(torch.randn(hidden, intermediate)))
    narrow_caches = [(torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8))]
    with pytest.raises(ValueError, match="prefill_attention for head_dim 8"):  # no fast path: SDPA's, from Python
        ops.small_layers(x, [narrow], narrow_caches, tokens, rows, torch.ones(64, 8), torch.ones(64, 8), 4, 1e-5,
                         0.3, chunks)
