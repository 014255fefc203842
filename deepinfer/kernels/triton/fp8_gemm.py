"""A linear on block-scaled FP8 weights kept in FP8: out = x @ (weight * scale)^T.

The weight [N, K] is float8_e4m3fn with one float32 scale per (block_n x block_k) tile
(DeepSeek's `weight_scale_inv`, 128x128). Each program computes a BLOCK_M x BLOCK_N tile of the
output, walking K one scale tile at a time: the FP8 tile is widened to the activations' dtype
(exact: every e4m3 value is a bf16 value), multiplied with them in fp32 by `tl.dot`, and the
partial product is scaled by its tile's one scale before it is added. Activations stay in their
dtype (weights-only FP8): a decode step reads half the weight bytes of bf16 and no activation is
quantized, so the result differs from dequantize-then-matmul only by summation order.

Not `torch._scaled_mm`: its 128x128 weight scales come with 1x128 activation scales
(activations quantized to FP8 per token and tile) and cuBLAS's layout rules for them, which
change the numerics and could not be checked without a GPU; this kernel runs, and is tested,
under the interpreter as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import interpreting


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    QBLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # BLOCK_N divides QBLOCK_N: the whole tile of output columns shares one scale row.
    scale_row = s_ptr + (pid_n * BLOCK_N // QBLOCK_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        k = tile * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
        )
        if DOT_FP32:  # full-precision fp32 products (the reference's)
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # 16-bit operands, fp32 accumulation
            part = tl.dot(x, tl.trans(w.to(x.dtype)))  # [BM, BN]
        acc += part * tl.load(scale_row + tile)
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), weight [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)]
    float32 -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k = block
    if weight.shape[1] != k or scale.shape != (-(-n // block_n), -(-k // block_k)):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and scale {tuple(scale.shape)} do not "
            f"make a {block_n}x{block_k}-block FP8 linear"
        )
    tile_n = min(64, block_n)
    if block_n % tile_n or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"FP8 blocks of {block_n}x{block_k} are not supported by the Triton kernel")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    scale = scale.float().contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # The interpreter multiplies 16-bit dot operands as raw bits: fp32 there, and for fp32 inputs.
    dot_fp32 = x.dtype == torch.float32 or interpreting()
    tile_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    _fp8_block_gemm_kernel[grid](
        x, weight, scale, out, m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        QBLOCK_N=block_n, BLOCK_M=tile_m, BLOCK_N=tile_n, BLOCK_K=block_k,
        DOT_FP32=dot_fp32,
    )  # fmt: skip
    return out
