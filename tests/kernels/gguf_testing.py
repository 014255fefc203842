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
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        data = quants.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), qtype)
    else:
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        if name == "Q2_K":  # d and dmin end the block; weights reach about d * 15 * 3
            halves = rng.random((rows, cols // block, 2)) * scale / 45
            data[..., -4:] = halves.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 4)
        elif name in ("Q4_K", "Q5_K"):  # d and dmin lead the block; weights reach d * 63 * 15 (31)
            halves = rng.random((rows, cols // block, 2)) * scale / (400 if name == "Q4_K" else 800)
            data[..., :4] = halves.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 4)
        else:  # Q3_K, Q6_K: d ends the block; weights reach about d * 32 * 4 (Q6_K: d * 127 * 32)
            halves = rng.random((rows, cols // block, 1)) * scale / (100 if name == "Q3_K" else 1500)
            data[..., -2:] = halves.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    data = np.ascontiguousarray(data.reshape(rows, -1))
    return PackedMatrix(int(qtype), rows, cols, data)


def dequantized(matrix: PackedMatrix) -> np.ndarray:
    return quants.dequantize(matrix.data, GGMLQuantizationType(matrix.qtype)).astype(np.float32)


def activation_blocks(matrix: PackedMatrix) -> int:
    return 256 if GGMLQuantizationType(matrix.qtype).name.endswith("_K") else 32


def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's activation quantization in numpy float32: (q [M, K] int, d, s [M, K/block]).

    32-wide blocks are GGUF's Q8_0/Q8_1 (as llama.cpp makes them): q = round(x * 127 / amax),
    d = fp16(amax / 127), s = fp16(amax / 127 * sum q). 256-wide: d = amax / 127 in float32."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        if block == 32:
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        else:
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None])
    s = d * q.sum(-1).astype(np.float32)
    if block == 32:
        d, s = d.astype(np.float16).astype(np.float32), s.astype(np.float16).astype(np.float32)
    return q.reshape(x.shape).astype(np.int64), d, s


def block_mins(matrix: PackedMatrix) -> np.ndarray:
    """Q4_1's and Q5_1's per-block minimum m [rows, K/32] (zero for the other formats)."""
    blocks = matrix.cols // activation_blocks(matrix)
    if GGMLQuantizationType(matrix.qtype).name not in ("Q4_1", "Q5_1"):
        return np.zeros((matrix.rows, blocks), dtype=np.float32)
    raw = matrix.data.reshape(matrix.rows, blocks, -1)
    return raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)


def reference_product(x: np.ndarray, matrix: PackedMatrix) -> tuple[np.ndarray, np.ndarray]:
    """(y, magnitude): the product with activations quantized as the kernel does, in float64, and
    sum_k |x_q w| per output, which scales the kernel's float32 rounding. Q4_1's and Q5_1's min
    multiply the stored block sum s, as in the kernel."""
    block = activation_blocks(matrix)
    q, d, s = quantize_activations(x, block)
    xq = (q.reshape(x.shape[0], -1, block) * d[..., None].astype(np.float64)).reshape(x.shape)
    mins = block_mins(matrix).astype(np.float64)  # [rows, nb]
    w = dequantized(matrix).astype(np.float64) - np.repeat(mins, block, axis=1)
    return xq @ w.T + s.astype(np.float64) @ mins.T, np.abs(xq) @ np.abs(w).T + np.abs(s) @ np.abs(mins).T


def activation_error_bound(x: np.ndarray, matrix: PackedMatrix) -> np.ndarray:
    """|kernel - x W^T| bound from the activation quantization: per value half a step plus the
    fp16 rounding of the step (|q| <= 127), and for Q4_1's and Q5_1's min the rounding of the block
    sum."""
    block = activation_blocks(matrix)
    q, d, s = quantize_activations(x, block)
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, block)
    exact_d = np.abs(blocks).max(axis=-1) / 127
    per_value = exact_d / 2 + 127 * np.abs(exact_d - d)  # [M, nb]
    mins = block_mins(matrix).astype(np.float64)
    w = np.abs(dequantized(matrix).astype(np.float64) - np.repeat(mins, block, axis=1))
    bound = per_value @ w.reshape(matrix.rows, -1, block).sum(-1).T
    sum_error = np.abs(s - d * q.reshape(x.shape[0], -1, block).sum(-1)) + block * per_value
    return bound + sum_error @ np.abs(mins).T
