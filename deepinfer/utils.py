"""Small shared helpers with no better home."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """DeepInfer's on-disk cache (converted weights, kernels): $DEEPINFER_CACHE or ~/.cache/deepinfer."""
    root = os.environ.get("DEEPINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deepinfer"
    )
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
