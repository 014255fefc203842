"""The engine's `device` and `dtype` options as torch objects."""

from __future__ import annotations

import torch


def torch_device(name: str) -> torch.device:
    """auto: CUDA when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
