"""The attention backend for a device, dtype and block size: the one place that knows them all.

Backends import base.py and nothing of each other; this module imports every backend, and the
model runner calls it once, at load.
"""

from __future__ import annotations

import torch

from model_worker.runner.attention.base import AttentionBackend
from model_worker.runner.attention.cpu_backend import CpuAttentionBackend
from model_worker.runner.attention.flash_attn_backend import (FLASH_ATTN_DTYPES, FlashAttentionBackend,
                                                              flash_attn_available)
from model_worker.runner.attention.torch_backend import TorchAttentionBackend
from model_worker.runner.attention.triton_backend import TritonAttentionBackend
from model_worker.runner.attention.triton_kernels import triton_available

ATTENTION_BACKEND_NAMES = ("auto", "cpu", "torch", "triton", "flash_attn")


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                             block_size: int) -> AttentionBackend:
    """"auto" on CUDA: flash-attn where it reads the paged cache in place (half precision, a block
    size that is a multiple of 256), else our Triton kernels, else flash-attn gathering K/V, else
    torch. On CPU: our CPU kernels where they build here (float32 and bfloat16), else torch (Triton
    runs on CPU only under its interpreter, for tests)."""
    if name not in ATTENTION_BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_NAMES)}; got {name!r}")
    if name == "auto":
        flash = device.type == "cuda" and dtype in FLASH_ATTN_DTYPES and flash_attn_available()
        if flash and block_size % FlashAttentionBackend.PAGED_BLOCK_MULTIPLE == 0:
            name = "flash_attn"
        elif device.type == "cuda" and triton_available():
            name = "triton"
        elif device.type == "cpu" and CpuAttentionBackend.available(dtype):
            name = "cpu"
        else:
            name = "flash_attn" if flash else "torch"
    if name == "cpu":
        if device.type != "cpu" or not CpuAttentionBackend.available(dtype):
            raise ValueError(f"attention_backend 'cpu' needs the CPU, float32 or bfloat16 and the CPU kernels "
                             f"built (a C++ compiler); got {device.type}, {dtype}")
        return CpuAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend(device)
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flash_attn' needs a CUDA device")
        if dtype not in FLASH_ATTN_DTYPES:
            raise ValueError(f"attention_backend 'flash_attn' needs float16 or bfloat16, not {dtype}")
        if not flash_attn_available():
            raise ValueError("attention_backend 'flash_attn' needs the flash-attn package (pip install flash-attn)")
        return FlashAttentionBackend(device)
    return TorchAttentionBackend()
