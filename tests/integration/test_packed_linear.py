"""Linear layers over oneDNN-packed weights compute what F.linear computes, at every batch size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_worker.runner import linear as packed

CPU_PACKS = {dtype: packed.packs("cpu", dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.5)])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_gives_f_linear_at_any_batch(dtype, atol, rows, with_bias):
    if not CPU_PACKS[dtype]:
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=generator).to(dtype)
    with torch.inference_mode():
        got = packed.linear(x, packed.pack(weight), bias)
    assert got.dtype == dtype and got.shape == (rows, 96)
    # bfloat16 rounds each output once (about 1/128 of values of size ~10 here); float32 differs
    # from F.linear only in the order of its sums.
    torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), atol=atol, rtol=1e-2)


def test_float32_packs_on_any_cpu_torch_builds_with_onednn():
    assert CPU_PACKS[torch.float32] == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("device, dtype", [("cuda", torch.float32), ("cuda", torch.bfloat16),
                                           ("cpu", torch.float16), ("meta", torch.float32)])
def test_only_cpu_float32_and_bfloat16_pack(device, dtype):
    assert not packed.packs(device, dtype)
