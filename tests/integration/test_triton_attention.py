"""Our Triton paged-attention kernels against the torch backend and a float64 reference.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on
CPU tensors: the same kernel source a GPU compiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_worker.runner.attention import triton_backend, triton_kernels
from model_worker.runner.attention.base import StepLayout
from model_worker.runner.attention.selector import create_attention_backend
from model_worker.runner.attention.torch_backend import TorchAttentionBackend
from model_worker.runner.attention.triton_backend import TritonAttentionBackend, build_tiles

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    not triton_kernels.triton_available() or not (triton_kernels.interpreting() or torch.cuda.is_available()),
    reason="needs triton, and a GPU or TRITON_INTERPRET=1")]

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not triton_kernels.interpreting() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def random_layout(rng: np.random.Generator, query_lens, start_positions, block_size: int, num_blocks: int) -> StepLayout:
    """A step over the given sequences, each with its context in randomly chosen (distinct) blocks,
    block tables right-padded with block 0 as the runner pads them."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    start_positions = np.asarray(start_positions, dtype=np.int64)
    context_lens = start_positions + query_lens
    query_starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_starts[1:])
    blocks_needed = -(-context_lens // block_size)
    assert blocks_needed.sum() <= num_blocks
    chosen = rng.permutation(num_blocks)[: blocks_needed.sum()]
    block_tables = np.zeros((len(query_lens), int(blocks_needed.max())), dtype=np.int64)
    for row, (first, count) in enumerate(zip(np.cumsum(blocks_needed) - blocks_needed, blocks_needed)):
        block_tables[row, :count] = chosen[first:first + count]
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = np.arange(query_starts[-1]) - (query_starts[:-1] - start_positions)[seq_of_token]
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return StepLayout(query_lens=query_lens, start_positions=start_positions, context_lens=context_lens,
                      query_starts=query_starts, block_tables=block_tables, slot_mapping=slot_mapping,
                      block_size=block_size)


def reference_attention(q, k_cache, v_cache, layout: StepLayout, scale: float) -> torch.Tensor:
    """float64, one token at a time, straight from the definition: token at position p of a
    sequence attends to positions [0, p] of its context, read through its block table."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    keys_flat = k_cache.double().reshape(-1, num_kv_heads, q.shape[2])
    values_flat = v_cache.double().reshape(-1, num_kv_heads, q.shape[2])
    for seq in range(len(layout.query_lens)):
        slots = layout.slots_for_positions(np.array([seq]), int(layout.context_lens[seq]))[0]
        for i in range(int(layout.query_lens[seq])):
            token = int(layout.query_starts[seq]) + i
            position = int(layout.start_positions[seq]) + i
            keys = keys_flat[slots[: position + 1]]  # (p + 1, kv_heads, D)
            values = values_flat[slots[: position + 1]]
            for head in range(num_heads):
                kv_head = head // (num_heads // num_kv_heads)
                weights = torch.softmax(keys[:, kv_head] @ q[token, head].double() * scale, dim=0)
                out[token, head] = weights @ values[:, kv_head]
    return out


def run_both(layout: StepLayout, num_heads: int, num_kv_heads: int, head_dim: int, num_blocks: int,
             dtype: torch.dtype, seed: int = 0) -> dict[str, tuple[torch.Tensor, ...]]:
    """q, and each backend's output and caches after the step: {"input": (q,), name: (out, k_cache, v_cache)}."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = int(layout.query_starts[-1])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim), randn(
        num_tokens, num_kv_heads, head_dim)
    # Random, not zero, cache contents: a kernel that reads a wrong block or slot cannot pass.
    k_cache = randn(num_blocks, layout.block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, layout.block_size, num_kv_heads, head_dim)
    results = {"input": (q,)}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(DEVICE)):
        caches = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
        metadata = backend.prepare(layout, DEVICE)
        out = backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), *caches, metadata, head_dim ** -0.5)
        results[backend.name] = (out.cpu(), caches[0].cpu(), caches[1].cpu())
    return results


def check_against_torch_and_reference(layout: StepLayout, num_heads: int, num_kv_heads: int, head_dim: int,
                                      num_blocks: int, dtype: torch.dtype, seed: int = 0) -> None:
    results = run_both(layout, num_heads, num_kv_heads, head_dim, num_blocks, dtype, seed)
    torch_out, torch_k, torch_v = results["torch"]
    triton_out, triton_k, triton_v = results["triton"]
    assert torch.equal(torch_k, triton_k) and torch.equal(torch_v, triton_v), "K/V written to other slots"
    reference = reference_attention(results["input"][0], torch_k, torch_v, layout, head_dim ** -0.5)
    tolerance = TOLERANCE[dtype]
    assert (triton_out.double() - reference).abs().max().item() <= tolerance
    assert (triton_out.float() - torch_out.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim", [
    (16, 4, 2, 64),   # the tiny model's shape
    (16, 9, 3, 64),   # SmolLM2: 9 query heads share 3 KV heads
    (5, 8, 2, 48),    # a block size no power of two, a head_dim that is padded to 64
    (1, 4, 4, 32),    # one token a block, no GQA
    (32, 32, 8, 128),  # Llama-3-8B's heads
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch_backend_and_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(block_size * 1000 + num_heads)
    # Decodes at context lengths that do not fill their last block, a prompt from position 0 longer
    # than a prefill tile, and prompt chunks over a paged context (start > 0).
    layout = random_layout(rng, query_lens=[1, 1, 37, 1, 5, 20, 1], start_positions=[20, 100, 0, 3, 40, 57, 0],
                           block_size=block_size, num_blocks=400)
    check_against_torch_and_reference(layout, num_heads, num_kv_heads, head_dim, 400, dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_steps(seed):
    """Random mixes of decodes and chunks, random block tables, random block sizes and GQA ratios."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([2, 3, 8, 16, 24]))
    num_kv_heads = int(rng.choice([1, 2, 4]))
    num_heads = num_kv_heads * int(rng.choice([1, 2, 3, 4, 8]))
    num_seqs = int(rng.integers(1, 9))
    query_lens = np.where(rng.random(num_seqs) < 0.5, 1, rng.integers(2, 40, num_seqs))
    start_positions = rng.integers(0, 90, num_seqs)
    num_blocks = int((-(-(query_lens + start_positions) // block_size)).sum()) + 8
    layout = random_layout(rng, query_lens, start_positions, block_size, num_blocks)
    check_against_torch_and_reference(layout, num_heads, num_kv_heads, 32, num_blocks, torch.float32, seed)


def test_padded_sequences_write_nothing_and_read_nothing():
    """A CUDA graph pads a decode batch with sequences of context 0 and slot -1: their rows come out
    as 0, they write no K/V, and the real rows are untouched by them."""
    rng = np.random.default_rng(7)
    layout = random_layout(rng, [1, 1, 1], [9, 30, 4], block_size=16, num_blocks=32)
    padded = StepLayout(query_lens=np.array([1, 1, 1, 1, 1]), start_positions=np.array([9, 30, 4, 0, 0]),
                        context_lens=np.array([10, 31, 5, 0, 0]), query_starts=np.arange(6),
                        block_tables=np.vstack([layout.block_tables, np.zeros((2, layout.block_tables.shape[1]), np.int64)]),
                        slot_mapping=np.concatenate([layout.slot_mapping, [-1, -1]]), block_size=16)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 4, 32, generator=generator), torch.randn(5, 2, 32, generator=generator),
               torch.randn(5, 2, 32, generator=generator))
    k_cache, v_cache = torch.randn(32, 16, 2, 32, generator=generator), torch.randn(32, 16, 2, 32, generator=generator)
    backend = TritonAttentionBackend(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(q[:3], k[:3], v[:3], expected_k, expected_v, torch_backend.prepare(layout, DEVICE),
                                     32 ** -0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(padded, DEVICE), 32 ** -0.5)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert (out[:3] - expected).abs().max().item() <= 1e-5
    assert torch.count_nonzero(out[3:]) == 0


def test_build_tiles():
    seqs, offsets = build_tiles(np.array([1, 17, 16, 40]), 16)
    assert seqs.tolist() == [0, 1, 1, 2, 3, 3, 3]
    assert offsets.tolist() == [0, 0, 16, 0, 0, 16, 32]


def test_backend_choice(monkeypatch):
    from model_worker.runner.cpu_kernels import ops

    cpu = torch.device("cpu")
    # On CPU "auto" is our kernels where they build here (CI builds them), else torch.
    assert create_attention_backend("auto", cpu, torch.float32, 16).name == "cpu"
    assert create_attention_backend("torch", cpu, torch.bfloat16, 16).name == "torch"
    monkeypatch.setattr(ops, "kernels", lambda: None)
    assert create_attention_backend("auto", cpu, torch.float32, 16).name == "torch"
    with pytest.raises(ValueError, match="CPU kernels"):
        create_attention_backend("cpu", cpu, torch.float32, 16)
    assert create_attention_backend("triton", cpu, torch.float32, 16).name == "triton"  # interpreted here
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_attention_backend("triton", cpu, torch.float32, 16)


# Compiled for a Hopper GPU (sm_90, the H100 and H200) with the ptxas that ships inside the triton
# wheel: no GPU needed. The interpreter above checks what the kernels compute; this checks that
# the GPU compiler takes them, for the shapes the engine launches. It runs in a fresh process,
# since kernels defined under TRITON_INTERPRET=1 cannot be compiled.
_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from model_worker.runner.attention import triton_kernels as ta

def signature(kernel, dtype):
    tensors = {"out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr"}
    return {name: ("*" + dtype if name in tensors else "*i64") if name.endswith("_ptr")
            else "fp32" if name == "scale" else "constexpr" if name.isupper() else "i64"
            for name in kernel.arg_names}

variants = json.loads(sys.argv[1])
out = {}
for name, dtype, consts in variants:
    kernel = getattr(ta, name)
    compiled = triton.compile(ASTSource(kernel, signature(kernel, dtype), consts), target=GPUTarget("cuda", 90, 32))
    out[f"{name}/{dtype}/{consts}"] = {"shared": compiled.metadata.shared, "cubin": len(compiled.asm["cubin"])}
print(json.dumps(out))
"""


def test_kernels_compile_for_hopper():
    import json
    import os
    import subprocess
    import sys

    from model_worker.runner.attention.triton_kernels import BLOCK_N, PREFILL_BLOCK_Q, _next_pow2

    def attention(group, head_dim, block_q, fp32_dot, cache_block=16):
        """The constants paged_attention() launches with."""
        return dict(CACHE_BLOCK=cache_block, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, head_dim),
                    BLOCK_Q=block_q, BLOCK_M=max(16, _next_pow2(block_q * group)), BLOCK_N=BLOCK_N,
                    FP32_DOT=fp32_dot)

    variants = [
        ("_paged_attention_kernel", "bf16", attention(4, 128, 1, False)),  # Llama-3-8B decode
        ("_paged_attention_kernel", "bf16", attention(4, 128, PREFILL_BLOCK_Q, False)),  # and its prefill tiles
        ("_paged_attention_kernel", "bf16", attention(3, 64, PREFILL_BLOCK_Q, False, cache_block=5)),  # SmolLM2
        ("_paged_attention_kernel", "fp32", attention(3, 64, 1, True)),  # float32: exact products
        ("_write_kv_kernel", "bf16", dict(ROW=1024, ROW_PADDED=1024)),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(variants)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(compiled) == len(variants)
    # An H100/H200 block has 227 KiB of shared memory at most.
    assert all(0 < entry["cubin"] and entry["shared"] <= 227 * 1024 for entry in compiled.values()), compiled
