"""MXFP4 weights (DeepSeek-V4's routed experts): dequantized once at load time.

A weight [M, N] is stored as int8/uint8 [M, N / 2], two FP4 e2m1 codes per byte (the even column
in the low nibble), plus one e8m0 scale (a power of two, 2^(byte - 127)) per row and block of 32
columns: [M, N / 32]. e2m1 is sign | 2-bit exponent | 1-bit mantissa; its 16 codes decode to
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. weight = decode(code) * scale of its block.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED_DTYPES = (torch.int8, torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """packed [M, N / 2] int8|uint8 and scale [M, N / block] (e8m0 or float) -> float32 [M, N]."""
    if packed.dtype not in PACKED_DTYPES or packed.dim() != 2:
        raise ValueError(
            f"expected a 2-D int8/uint8 packed FP4 weight, got {packed.dtype} {tuple(packed.shape)}"
        )
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if cols % block or tuple(scale.shape) != (rows, cols // block):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not give one scale per {block} columns of a "
            f"{rows}x{cols} FP4 weight (expected {(rows, cols // block)})"
        )
    codes = packed.view(torch.uint8)
    nibbles = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2).long()  # [M, N]
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[nibbles]
    return values * scale_to_float(scale).repeat_interleave(block, dim=1)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales from e8m0 (float8_e8m0fnu, or its raw bytes as uint8) or any float dtype."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()
