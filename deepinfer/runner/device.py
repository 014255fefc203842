"""The engine's `device` option as a torch object (its dtype: model/loader/dtype.py)."""

from __future__ import annotations

import torch


def torch_device(name: str) -> torch.device:
    """auto: CUDA when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
