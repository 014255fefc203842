"""Block-quantized FP8 checkpoints (DeepSeek-V3 style): dequantize each weight at load time.

A quantized weight `X.weight` is stored as float8_e4m3fn next to `X.weight_scale_inv`, a float32
tensor with one scale per 128x128 tile (ceil-divided, so edge tiles may be partial):
weight = fp8.float() * scale_inv broadcast over its tile. loader/scaled.py pairs each weight with
its scale as the checkpoint streams in.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """fp8 weight [M, N] and per-tile scales [ceil(M/bm), ceil(N/bn)] -> float32 [M, N]."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(
            f"expected 2-D weight and scale, got {tuple(weight.shape)} and {tuple(scale_inv.shape)}"
        )
    rows, cols = weight.shape
    bm, bn = block
    expected = (-(-rows // bm), -(-cols // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not tile a {rows}x{cols} weight in {bm}x{bn} blocks "
            f"(expected {expected})"
        )
    scale = scale_inv.float().repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bn, dim=1)[:, :cols]
    return weight.float() * scale


def weight_block_size(raw_config: dict) -> tuple[int, int]:
    """The quantization tile from config.json's quantization_config (128x128 when absent)."""
    quant = raw_config.get("quantization_config") or {}
    block = quant.get("weight_block_size") or (128, 128)
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must have 2 entries, got {block!r}")
    return int(block[0]), int(block[1])
