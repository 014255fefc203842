"""Attention over a per-query list of rows with a sink logit (DeepSeek-V4's sparse attention).

Each query attends to the rows its index list names (the indexer's top-k compressed entries and
the sliding window's rows, -1 for none); a row is both key and value (shared-KV multi-query
attention); a learned per-head sink logit joins the softmax denominator, so the weights may sum to
less than 1 (model/deepseek_v4/sparse.py's `attend_with_sink` is the reference). One program per
(query, tile of BLOCK_H heads): the heads share each gathered row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import interpreting, next_power_of_2

BLOCK_H = 16


@triton.jit
def _sparse_sink_kernel(
    out_ptr, q_ptr, kv_ptr, index_ptr, sink_ptr, scale, num_heads, num_indices,
    stride_qn, stride_qh, stride_on, stride_oh, stride_kv, stride_index,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + query * stride_qn + heads[:, None] * stride_qh + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [H, D]
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    for k0 in range(0, num_indices, BLOCK_N):
        k = k0 + tl.arange(0, BLOCK_N)
        row = tl.load(index_ptr + query * stride_index + k, mask=k < num_indices, other=-1)
        valid = row >= 0
        kv = tl.load(
            kv_ptr + row.to(tl.int64)[:, None] * stride_kv + d[None, :],
            mask=valid[:, None] & d_ok[None, :],
            other=0.0,
        ).to(q.dtype)  # [N, D]
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * (scale * 1.4426950408889634)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of no rows changes nothing
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    # the sink joins the denominator only; a query with no rows gets 0 (all weight on the sink)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m, sink)
    keep = tl.math.exp2(m - top)
    total = denom * keep + tl.math.exp2(sink - top)
    out = acc * (keep / total)[:, None]
    tl.store(
        out_ptr + query * stride_on + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )


def sparse_attention_with_sink(
    q: torch.Tensor,  # [n, H, D]
    kv: torch.Tensor,  # [S, D]: the rows (keys and values)
    indices: torch.Tensor,  # [n, K] int: the rows each query attends to, -1 for none (no repeats)
    sinks: torch.Tensor,  # [H] sink logits
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    n, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if n == 0:
        return out
    # Triton's interpreter multiplies bf16 dot operands as their raw bits: upcast there.
    dot_fp32 = q.dtype == torch.bfloat16 and interpreting()
    _sparse_sink_kernel[(n, triton.cdiv(num_heads, BLOCK_H))](
        out, q, kv, indices, sinks, scale, num_heads, indices.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv.stride(0), indices.stride(0),
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim), BLOCK_H=BLOCK_H, BLOCK_N=32,
        DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 or q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
