"""Run Triton kernels under Triton's interpreter where there is no GPU.

Triton picks the interpreter when a kernel is defined, so this must be set before anything
imports model_worker.runner.attention.triton_kernels; a conftest at the root of tests/ is imported first.
The kernels are then tested on CPU tensors against the torch backend (tests/integration/test_triton_attention.py).
"""

from __future__ import annotations

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
