"""Attention over the paged KV cache.

    base.py                the interface (StepLayout, AttentionBackend) and write_kv; no backend
    torch_backend.py       F.scaled_dot_product_attention over gathered K/V (CPU and CUDA)
    triton_backend.py      our Triton kernels (triton_kernels.py), K/V read in place (CUDA)
    flash_attn_backend.py  flash-attn's varlen kernel (CUDA, half precision)
    selector.py            create_attention_backend: which backend for a device, dtype, block size

This `__init__` imports nothing, so importing base.py never loads a backend (or Triton).
"""
