"""Routed experts as two grouped GEMMs over the (token, expert) pairs sorted by expert.

The pairs are sorted by expert (stable, as model/layers/moe.py's RoutedExperts does) and each
expert's run padded to a multiple of BLOCK_M rows, so every tile of BLOCK_M rows belongs to one
expert (`tile_expert`). The first kernel computes a tile's gate and up columns from that expert's
w13 and applies the SwiGLU (clamped by `limit`, DeepSeek-V4); the second multiplies the
activations by the expert's w2. Pair outputs come back in sorted order and are combined with the
routing weights by the model's own `combine_pairs`, so the sum order is the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import interpreting, next_power_of_2

BLOCK_M = 16  # rows per tile; each expert's run is padded to a multiple of it


@triton.jit
def _gate_up_kernel(
    act_ptr, x_ptr, w13_ptr, rows_ptr, tile_expert_ptr, limit, hidden, inter,
    stride_act, stride_x, stride_we, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(rows_ptr + m)  # the x row of each sorted pair; -1 for padding
    m_ok = source >= 0
    n_ok = n < inter
    k = tl.arange(0, BLOCK_K)
    w = w13_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + k < hidden
        a = tl.load(
            x_ptr + source[:, None] * stride_x + k0 + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w + n[None, :] * stride_wn + (k0 + k)[:, None], mask=w_mask, other=0.0)  # [K, N]
        w_up = tl.load(w + (inter + n[None, :]) * stride_wn + (k0 + k)[:, None], mask=w_mask, other=0.0)
        if DOT_FP32:
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        gate += tl.dot(a, w_gate, input_precision=PRECISION)
        up += tl.dot(a, w_up, input_precision=PRECISION)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    tl.store(
        act_ptr + m[:, None] * stride_act + n[None, :], act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :]
    )


@triton.jit
def _down_kernel(
    out_ptr, act_ptr, w2_ptr, tile_expert_ptr, hidden, inter,
    stride_out, stride_act, stride_we, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < hidden
    k = tl.arange(0, BLOCK_K)
    w = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + k < inter
        a = tl.load(act_ptr + m[:, None] * stride_act + k0 + k[None, :], mask=k_ok[None, :], other=0.0)
        b = tl.load(
            w + n[None, :] * stride_wn + (k0 + k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
        )
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(
        out_ptr + m[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :]
    )


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (order [P]: pair indices sorted by expert, stable; rows [tiles * BLOCK_M]:
    the x row of each padded sorted position, -1 for padding; tile_expert [tiles]). Reads the
    padded total back to the host (one sync), which sizes the layout."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    expert = flat[order]  # of each sorted pair
    rank = torch.arange(order.shape[0], device=flat.device) - (counts.cumsum(0) - counts)[expert]
    dest = (padded.cumsum(0) - padded)[expert] + rank  # increasing: padding only between experts
    total = int(padded.sum())
    rows = torch.full((total,), -1, dtype=torch.int64, device=flat.device)
    rows[dest] = order // top_k
    tile_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // BLOCK_M, output_size=total // BLOCK_M
    )
    return order, rows, tile_expert


def expert_outputs(
    x: torch.Tensor,  # [T, hidden]
    rows: torch.Tensor,  # [M] from sort_pairs
    tile_expert: torch.Tensor,  # [M / BLOCK_M]
    w13: torch.Tensor,  # [E, 2I, hidden]
    w2: torch.Tensor,  # [E, hidden, I]
    limit: float | None = None,
) -> torch.Tensor:  # [M, hidden]: each padded sorted pair's expert output (padding rows: garbage)
    hidden, inter = x.shape[1], w2.shape[2]
    tiles = tile_expert.shape[0]
    act = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape[0], hidden, dtype=x.dtype, device=x.device)
    if tiles == 0:
        return out
    # Triton's interpreter multiplies bf16 dot operands as their raw bits: upcast there.
    dot_fp32 = x.dtype == torch.bfloat16 and interpreting()
    precision = "ieee" if dot_fp32 or x.dtype == torch.float32 else "tf32"
    block_n = min(64, next_power_of_2(inter))
    _gate_up_kernel[(tiles, triton.cdiv(inter, block_n))](
        act, x, w13, rows, tile_expert, 0.0 if limit is None else limit, hidden, inter,
        act.stride(0), x.stride(0), w13.stride(0), w13.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=min(64, next_power_of_2(hidden)),
        HAS_LIMIT=limit is not None, DOT_FP32=dot_fp32, PRECISION=precision,
    )  # fmt: skip
    block_n = min(64, next_power_of_2(hidden))
    _down_kernel[(tiles, triton.cdiv(hidden, block_n))](
        out, act, w2, tile_expert, hidden, inter,
        out.stride(0), act.stride(0), w2.stride(0), w2.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=min(64, next_power_of_2(inter)),
        DOT_FP32=dot_fp32, PRECISION=precision,
    )  # fmt: skip
    return out


def expert_pairs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (token, expert) pair's expert output, every expert local: x [T, hidden], topk_ids
    [T, k] -> (order [P], outputs [P, hidden] in that order); the model combines them with the
    routing weights (expert_parallel.combine_pairs), as for its own run_experts."""
    order, rows, tile_expert = sort_pairs(topk_ids, w13.shape[0])
    padded = expert_outputs(x, rows, tile_expert, w13, w2, limit)
    return order, padded[rows >= 0]
