"""How a step's host-built index arrays (token ids, positions, slots, block tables, lengths) reach
the device.

On the CPU they are wrapped as they are (no copy). On CUDA they are packed into one pinned host
buffer and sent with a single non-blocking copy: one transfer per step instead of one synchronous
transfer per tensor, and the host goes on preparing the step while it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# int64 arrays -> tensors of the same shapes on the device, in order.
Upload = Callable[[list[np.ndarray]], list[torch.Tensor]]


def direct_upload(device: torch.device) -> Upload:
    """Each array wrapped (CPU) or copied on its own."""

    def upload(arrays: list[np.ndarray]) -> list[torch.Tensor]:
        return [torch.from_numpy(a).to(device) for a in arrays]

    return upload


class PackedUpload:
    """Every array of a call in one host buffer, one copy to the device. `pin`: the buffer is
    page-locked and the copy non-blocking (CUDA); without it the packing alone runs (the CPU
    tests of the layout)."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device = device
        self.pin = pin
        self._host = torch.empty(0, dtype=torch.int64)
        # Recorded after the last copy: the buffer is refilled only once that copy has read it.
        self._copied: torch.cuda.Event | None = None

    def _buffer(self, total: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < total:
            size = max(total, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=self.pin)
        return self._host[:total]

    def __call__(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        host = self._buffer(sum(sizes))
        if host.numel():
            np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays], out=host.numpy())
        # A copy of the CPU buffer when not pinned: the next call refills it.
        flat = host.to(self.device, non_blocking=True) if self.pin else host.clone()
        if self.pin:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays)]


def upload_for(device: torch.device) -> Upload:
    """Pinned, packed and non-blocking on CUDA; each array wrapped as it is elsewhere."""
    return PackedUpload(device, pin=True) if device.type == "cuda" else direct_upload(device)
