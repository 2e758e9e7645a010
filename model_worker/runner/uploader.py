"""Step inputs to the device in one asynchronous copy: no host sync before the forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class Uploader:
    """Sends int64 numpy arrays to the device in one copy from one pinned buffer, without waiting.

    On CPU (or with pin=False) it hands back torch views of the arrays, no copy. The pinned buffer
    is reused, so before refilling it the host waits for the previous copy to finish; by then the
    step that used it has already been read back, so that wait costs nothing.
    """

    def __init__(self, device: torch.device, pin: bool | None = None) -> None:
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self._host: torch.Tensor | None = None
        self._copied: Any = None  # a CUDA event after the last copy

    def __call__(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        if not self.pin:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device) for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self._host is None or self._host.numel() < total:
            self._host = torch.empty(max(total, 2 * (0 if self._host is None else self._host.numel())),
                                     dtype=torch.int64, pin_memory=self.device.type == "cuda")
        elif self._copied is not None:
            self._copied.synchronize()
        host = self._host[:total]
        host_np = host.numpy()
        offset = 0
        for array, size in zip(arrays, sizes):
            host_np[offset:offset + size] = array.reshape(-1)
            offset += size
        packed = torch.empty(total, dtype=torch.int64, device=self.device)
        packed.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        out, offset = [], 0
        for array, size in zip(arrays, sizes):
            out.append(packed[offset:offset + size].view(array.shape))
            offset += size
        return out
