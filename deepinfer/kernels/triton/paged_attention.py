"""Paged attention over the engine's block tables: decode rows and chunked-prefill tiles.

The cache of one layer is [num_slots, 2, num_kv_heads, head_dim] (K then V per slot), slot =
block * block_size + offset, the layout every backend shares (attention/backend.py). Both kernels
read K/V straight from it through the block table, with an online softmax in fp32; an fp8 cache is
read as value * scale (one scale for K and one for V per layer).

- decode: one program per (row, KV head, part of the context) computes the GROUP query heads
  that share the KV head, so each K/V row is loaded once for the group (GQA); a row's keys are
  [start, length), cut into parts of PART_LEN positions whose partial softmax sums a second
  kernel merges (one part: no merge), so that batch-1 decode runs more than KV-heads programs.
- prefill: one program per (tile of BLOCK_M queries of one sequence, query head), with tl.dot on
  [BLOCK_M, D] x [D, BLOCK_N] tiles; the causal mask and the window are per query position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import interpreting, next_power_of_2


@triton.jit
def _decode_kernel(
    out_ptr, part_ptr, q_ptr, cache_ptr, tables_ptr, lens_ptr, starts_ptr,
    scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kv, stride_ch, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PART_LEN: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    length = tl.load(lens_ptr + row)
    first = tl.load(starts_ptr + row)
    end = length
    if SPLIT:  # this program's keys: part `part` of PART_LEN positions from the row's start
        first = first + part * PART_LEN
        end = tl.minimum(first + PART_LEN, length)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [G, D]
    q = q * (scale * 1.4426950408889634)  # scores in log2 units: exp2 below
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    kv_base = cache_ptr + kv_head * stride_ch
    # Every tile holds at least one key of [first, end), so the running max is finite after it;
    # a part past the row's end runs no tile and leaves (-inf, 0, 0), which the merge ignores.
    for tile in range(first, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(tables_ptr + row * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(kv_base + slot[:, None] * stride_slot + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(tl.float32) * k_scale  # [N, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        v = tl.load(kv_base + stride_kv + slot[:, None] * stride_slot + d[None, :], mask=kv_mask, other=0.0)
        v = v.to(tl.float32) * v_scale  # [N, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # partials [R, H, parts, D_PAD + 2]: the unnormalized sum, then the max and the denominator
        parts = tl.num_programs(2)
        base = part_ptr + ((row * GROUP * tl.num_programs(1) + heads) * parts + part) * (D_PAD + 2)
        tl.store(base[:, None] + d[None, :], acc, mask=g_ok[:, None])  # padded columns hold 0
        tl.store(base + D_PAD, m, mask=g_ok)
        tl.store(base + D_PAD + 1, denom, mask=g_ok)
    else:
        out = acc / denom[:, None]
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _merge_kernel(
    out_ptr, part_ptr, num_parts, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, D_PAD)
    i_ok = i < num_parts
    base = part_ptr + ((row * tl.num_programs(1) + head) * num_parts + i) * (D_PAD + 2)  # [P]
    m = tl.load(base + D_PAD, mask=i_ok, other=float("-inf"))
    denom = tl.load(base + D_PAD + 1, mask=i_ok, other=0.0)
    acc = tl.load(base[:, None] + d[None, :], mask=i_ok[:, None], other=0.0)  # [P, D]
    top = tl.max(m, axis=0)  # finite: the first part always holds keys
    weight = tl.math.exp2(m - top)  # 0 for the empty parts (m = -inf)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, cache_ptr, tables_ptr, tile_seq_ptr, tile_token_ptr, tile_pos_ptr, tile_count_ptr,
    scale, k_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kv, stride_ch, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    token0 = tl.load(tile_token_ptr + tile)  # step token index of the tile's first query
    pos0 = tl.load(tile_pos_ptr + tile)  # its context position
    count = tl.load(tile_count_ptr + tile)  # queries in the tile (<= BLOCK_M)
    mi = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    q_ok = mi < count
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (token0 + mi)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=q_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = pos0 + mi
    end = pos0 + count  # keys after the tile's last query are never seen
    # window 0: none (branch-free, so both cases compile to one kernel)
    first = tl.where(window > 0, tl.maximum(pos0 - window + 1, 0), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_base = cache_ptr + kv_head * stride_ch
    for key0 in range(first - first % BLOCK_N, end, BLOCK_N):
        pos = key0 + tl.arange(0, BLOCK_N)
        valid = (pos >= first) & (pos < end)
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(kv_base + slot[:, None] * stride_slot + d[None, :], mask=kv_mask, other=0.0)
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (scale * 1.4426950408889634)  # [M, N]
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        seen = seen & ((pos[None, :] > q_pos[:, None] - window) | (window <= 0))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row may see nothing in this tile (outside its window, or a padding row): keep it at 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        v = tl.load(kv_base + stride_kv + slot[:, None] * stride_slot + d[None, :], mask=kv_mask, other=0.0)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(
        out_ptr + (token0 + mi)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_ok[:, None] & d_ok[None, :],
    )


def decode_parts(context_lens: list[int], part_len: int) -> int:
    """How many parts of `part_len` positions the longest of these contexts (each measured from
    its row's start) splits into: one program per part, so a single long row fills the GPU."""
    return max([1] + [-(-n // part_len) for n in context_lens])


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    starts: torch.Tensor,
    block_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_parts: int = 1,
    part_len: int = 128,
) -> None:
    """out/q [R, H, D] (one query per row), cache [S, 2, KVH, D], block_tables [R, W], lens and
    starts [R] int (row r attends to positions starts[r] .. lens[r] - 1, lens[r] > starts[r]);
    rows up to num_parts * part_len positions long (`decode_parts`)."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[2]
    if rows == 0:
        return
    group = num_heads // num_kv_heads
    d_pad = next_power_of_2(head_dim)
    split = num_parts > 1
    partials = (
        torch.empty(rows, num_heads, num_parts, d_pad + 2, dtype=torch.float32, device=q.device)
        if split
        else out  # unused
    )
    _decode_kernel[(rows, num_kv_heads, num_parts)](
        out, partials, q, cache, block_tables, lens, starts,
        scale, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(2, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=32, PART_LEN=part_len,
        SPLIT=split,
    )  # fmt: skip
    if split:
        _merge_kernel[(rows, num_heads)](
            out, partials, num_parts, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, PARTS_PAD=max(2, 1 << (num_parts - 1).bit_length()),
        )  # fmt: skip


def paged_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    block_m: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """out/q [T, H, D]; tiles [4, N] int (from `prefill_tiles`): per tile its block-table row,
    first step token, first query position and query count; causal within each sequence."""
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return
    _, num_heads, head_dim = q.shape
    # Triton's interpreter multiplies bf16 dot operands as their raw bits: upcast there.
    dot_fp32 = q.dtype == torch.bfloat16 and interpreting()
    _prefill_kernel[(num_tiles, num_heads)](
        out, q, cache, block_tables, tiles[0], tiles[1], tiles[2], tiles[3],
        scale, k_scale, v_scale, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // cache.shape[2], HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=32,
        DOT_FP32=dot_fp32,
        # fp32 dots in full precision (the reference's); 16-bit operands take Triton's default
        PRECISION="ieee" if dot_fp32 or q.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def prefill_tiles(
    chunks: list[tuple[int, int, int, int]], block_m: int, device: torch.device
) -> torch.Tensor:
    """chunks: (block-table row, first step token, query count, context length after the step) ->
    [4, N] int64 tiles of at most `block_m` queries each."""
    columns: list[tuple[int, int, int, int]] = []
    for seq, token, num_q, length in chunks:
        first_pos = length - num_q
        for offset in range(0, num_q, block_m):
            columns.append((seq, token + offset, first_pos + offset, min(block_m, num_q - offset)))
    table = torch.tensor(columns, dtype=torch.int64).reshape(-1, 4)
    return table.t().contiguous().to(device)
