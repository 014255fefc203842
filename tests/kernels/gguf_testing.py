"""Random GGUF blocks in every natively computed format, and the references the kernels are held to.

The 32-wide formats are quantized from Gaussian weights by the `gguf` package itself; the k-quants
(which it cannot quantize) are random bytes with small fp16 scales, every byte pattern being a
valid block. The references dequantize with the `gguf` package, independent of our C code.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from deepinfer.kernels.gguf_blocks import PACKED_TYPES, PackedMatrix

FORMATS = sorted(PACKED_TYPES)


def random_packed(
    name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05
) -> PackedMatrix:
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        data = quants.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), qtype)
    else:
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        if name == "Q4_K":  # d and dmin lead the block; weights reach about d * 63 * 15
            halves = (rng.random((rows, cols // block, 2)) * scale / 400).astype(np.float16)
            data[..., :4] = halves.view(np.uint8).reshape(rows, cols // block, 4)
        else:  # Q6_K: d ends the block; weights reach about d * 127 * 32
            halves = (rng.random((rows, cols // block, 1)) * scale / 1500).astype(np.float16)
            data[..., -2:] = halves.view(np.uint8).reshape(rows, cols // block, 2)
    data = np.ascontiguousarray(data.reshape(rows, -1))
    return PackedMatrix(int(qtype), rows, cols, data)


def dequantized(matrix: PackedMatrix) -> np.ndarray:
    return quants.dequantize(matrix.data, GGMLQuantizationType(matrix.qtype)).astype(np.float32)


def activation_blocks(matrix: PackedMatrix) -> int:
    return 256 if GGMLQuantizationType(matrix.qtype).name.endswith("_K") else 32


def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization, in numpy float32: (q [M, K] int, d [M, K/block])."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None])
    return q.reshape(x.shape).astype(np.int64), d


def reference_product(x: np.ndarray, matrix: PackedMatrix) -> tuple[np.ndarray, np.ndarray]:
    """(y, magnitude): the product with activations quantized as the kernel does, in float64, and
    sum_k |x_q w| per output, which scales the kernel's float32 rounding."""
    block = activation_blocks(matrix)
    q, d = quantize_activations(x, block)
    xq = (q.reshape(x.shape[0], -1, block) * d[..., None].astype(np.float64)).reshape(x.shape)
    w = dequantized(matrix).astype(np.float64)
    return xq @ w.T, np.abs(xq) @ np.abs(w).T


def activation_error_bound(x: np.ndarray, matrix: PackedMatrix) -> np.ndarray:
    """|kernel - x W^T| <= sum over blocks of d_a / 2 * sum |w| (rounding to the nearest step)."""
    block = activation_blocks(matrix)
    _, d = quantize_activations(x, block)
    w = np.abs(dequantized(matrix).astype(np.float64)).reshape(matrix.rows, -1, block).sum(-1)
    return (d.astype(np.float64) / 2) @ w.T
