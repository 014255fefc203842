"""MLA decode over the paged latent cache (model/deepseek_v3/mla.py's absorbed form).

The cache of one layer is [num_slots, rank + rope]: the KV latent then the shared rope key. A
decode row's query, already projected into the latent space with W_UK, is [H, rank + rope]; all
heads attend over the same latent rows (one KV head), the keys being whole rows and the values
their first `rank` columns. One program per (row, tile of BLOCK_H heads): each latent row is read
once for the tile, scores and the weighted sum are `tl.dot`s over [BLOCK_H, rank] x [rank, N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import interpreting, next_power_of_2

BLOCK_H = 16  # heads per program: a tensor-core tile


@triton.jit
def _mla_decode_kernel(
    out_ptr, q_ptr, cache_ptr, tables_ptr, lens_ptr, scale, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_table,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    r_ok = r < RANK
    e_ok = e < ROPE
    q_row = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [H, R]
    q_rope = tl.load(q_row + RANK + e[None, :], mask=h_ok[:, None] & e_ok[None, :], other=0.0)  # [H, E]
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    length = tl.load(lens_ptr + row)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for tile in range(0, length, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < length
        block = tl.load(tables_ptr + row * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        rows = cache_ptr + slot[:, None] * stride_slot
        latent = tl.load(rows + r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0).to(q_lat.dtype)
        k_rope = tl.load(rows + RANK + e[None, :], mask=valid[:, None] & e_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)  # [H, N]
        s += tl.dot(q_rope, tl.trans(k_rope.to(q_rope.dtype)), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * (scale * 1.4426950408889634), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds a key
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(
        out_ptr + row * stride_ot + heads[:, None] * stride_oh + r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & r_ok[None, :],
    )


def mla_decode_latent(
    query: torch.Tensor,  # [D, H, rank + rope]: the absorbed query
    cache: torch.Tensor,  # [S, rank + rope]
    rank: int,
    block_tables: torch.Tensor,  # [D, W]
    lens: torch.Tensor,  # [D] context length of each row (> 0)
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [D, H, rank]: the attended latent
    rows, num_heads, width = query.shape
    out = torch.empty(rows, num_heads, rank, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    # Triton's interpreter multiplies bf16 dot operands as their raw bits: upcast there.
    dot_fp32 = query.dtype == torch.bfloat16 and interpreting()
    _mla_decode_kernel[(rows, triton.cdiv(num_heads, BLOCK_H))](
        out, query, cache, block_tables, lens, scale, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), cache.stride(0), block_tables.stride(0),
        RANK=rank, ROPE=width - rank, RANK_PAD=next_power_of_2(rank), ROPE_PAD=next_power_of_2(width - rank),
        BLOCK_H=BLOCK_H, BLOCK_SIZE=block_size, BLOCK_N=32, DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 or query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
