"""Small generated pictures for the V4.1 vision tests, and the tiny checkpoint they need."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image

from tests.deepseek_v41.tiny_v41 import tiny_config


def png_bytes(seed: int, width: int = 12, height: int = 8) -> bytes:
    """A random RGB picture as a PNG; the preprocessing scales it up to its minimum size."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def png_base64(seed: int, width: int = 12, height: int = 8) -> str:
    return base64.b64encode(png_bytes(seed, width, height)).decode()


def vision_config(**text_overrides: Any) -> dict[str, Any]:
    """The tiny V4.1 with its tower merging 3 x 3 patches, as DeepSeek's (the preprocessing
    counts tokens for that ratio)."""
    config = tiny_config(**text_overrides)
    config["vision_config"]["downsample_ratio"] = 3
    return config
