"""Linear layers on CPU with their weights packed once at load, for oneDNN's matmul.

`F.linear` on CPU hands a plain row-major weight to the GEMM library on every call, which then
lays it out for its kernels again each time. For a decode step, a handful of rows against every
weight of the model, that costs as much as the matmul: in float32 a batch-2 step took twice a
batch-1 step, and an LM head of 49152 rows read at half the bandwidth the machine has. oneDNN
reads a weight reordered once into its own blocked layout (`torch.ops.mkldnn`, what inductor's
CPU freezing pass and vLLM's CPU backend do), at any batch size, in float32 and bfloat16
(docs/benchmarks.md, "Decode steps at the memory limit").

The packed weight is an opaque mkldnn tensor that only the functions below read. A layer's
residual additions run as post-ops of its matmuls (oneDNN adds to the output tile it has in
registers), not as passes over the activations. Where oneDNN cannot
run the dtype (bfloat16 on a CPU without AVX-512), `packs(device, dtype)` says so and the decoder
keeps plain weights and `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def packs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype are packed on this device: CPU, oneDNN built in, the dtype
    supported, and a probe matmul through a packed weight that agrees with F.linear."""
    if device_type != "cpu" or dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype)
    x = torch.randn(3, 64, generator=generator).to(dtype)
    other = torch.randn(3, 48, generator=generator).to(dtype)
    plain = F.linear(x, weight, bias).float()
    try:
        packed_weight = pack(weight)
        checks = [(linear(x, packed_weight, bias), plain),
                  (linear_add(x, packed_weight, bias, other), plain + other.float())]
    except RuntimeError:
        return False
    return all(torch.allclose(got.float(), want, rtol=2e-2, atol=5e-2) for got, want in checks)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out_features, in_features) reordered for oneDNN; read only by `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias for a weight from `pack`; x is (rows, in_features), in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def linear_add(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """residual + (x @ W^T + bias), the addition a post-op of the matmul (no pass of its own);
    residual (rows, out_features) in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed_weight, bias, "add")

