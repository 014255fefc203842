"""The CPU's stand-in for a CUDA graph capture (runner/graphs.py's GraphCapture)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class ReplayByCall:
    """A replay runs the recorded step again and writes its outputs over the captured ones (a
    graph rewrites the same memory from the same static buffers)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.captures = 0

    def capture(
        self, step: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable[[], None]]:
        self.captures += 1
        outputs = step()

        def replay() -> None:
            for static, fresh in zip(outputs, step()):
                static.copy_(fresh)

        return outputs, replay
