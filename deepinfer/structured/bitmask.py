"""Apply packed grammar bitmasks to logits (the only torch code of the structured layer).

Layout: int32 words, 32 tokens per word, token t allowed when bit `t % 32` of word `t // 32` is
set. On a little-endian machine (every CPU and GPU we run on) the same memory read as bytes has
token t at bit `t % 8` of byte `t // 8`.

How: each mask byte indexes a 256 x 8 table of +inf (allowed) / -inf (disallowed), giving a bias
row per constrained sequence, and `logits = minimum(logits, bias)` applies it. Both are plain
vectorized kernels; `masked_fill_` with a bool mask measured 10x slower on CPU.

Vocabulary sizes: the model's logits may be wider than the bitmask covers (embedding tables padded
past the tokenizer); those extra columns have no text and are set to -inf in constrained rows.
A bitmask wider than the logits is cut to the logits' width.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from deepinfer.structured.mask_timing import MASK_TIMING
from deepinfer.structured.tokenizer_info import bitmask_words

if sys.byteorder != "little":
    raise ImportError("deepinfer.structured.bitmask assumes a little-endian machine")

_BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_BOOL_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit k of byte value b."""
    table = _BOOL_TABLES.get(device)
    if table is None:
        values = torch.arange(256, device=device).unsqueeze(-1)
        table = _BOOL_TABLES.setdefault(device, ((values >> torch.arange(8, device=device)) & 1).bool())
    return table


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    table = _BIAS_TABLES.get((device, dtype))
    if table is None:
        inf = torch.tensor(float("inf"), dtype=dtype, device=device)
        table = _BIAS_TABLES.setdefault((device, dtype), torch.where(_byte_bits(device), inf, -inf))
    return table


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool | None = None) -> torch.Tensor:
    """A CPU int32 bitmask [rows, ceil(vocab_size / 32)], all tokens allowed.

    Pinned when CUDA is present, so the per-step copy to the device can be asynchronous."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 -> [N, vocab_size] bool (True = allowed); columns past 32 * W are False."""
    n, words = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).int()
    bits = _byte_bits(bitmask.device).index_select(0, as_bytes).view(n, words * 32)
    if vocab_size <= words * 32:
        return bits[:, :vocab_size]
    pad = torch.zeros((n, vocab_size - words * 32), dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], dim=1)


def apply_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Set disallowed tokens to -inf, in place; returns `logits`.

    logits: [B, V] on any device. bitmask: [N, W] int32 (CPU or the logits' device).
    rows: the logits row each bitmask row applies to (N of them); None means row i -> row i and
    N == B. Only constrained rows are listed, so unconstrained rows cost nothing.
    """
    start = time.perf_counter()
    _apply(logits, bitmask, rows)
    MASK_TIMING.apply_s += time.perf_counter() - start
    return logits


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask_ expects logits [B, V] and an int32 bitmask [N, W]")
    n, words = bitmask.shape
    if n == 0:
        return
    if rows is None and n != logits.shape[0]:
        raise ValueError(f"bitmask has {n} rows for {logits.shape[0]} logits rows; pass rows=")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    covered = min(logits.shape[1], words * 32)
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).int()
    bias = _bias_table(logits.device, logits.dtype).index_select(0, as_bytes).view(n, words * 32)[:, :covered]
    if rows is None:
        torch.minimum(logits[:, :covered], bias, out=logits[:, :covered])
        logits[:, covered:] = float("-inf")
        return
    index = torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    if index.numel() != n:
        raise ValueError(f"{index.numel()} row indices for {n} bitmask rows")
    selected = logits.index_select(0, index)
    torch.minimum(selected[:, :covered], bias, out=selected[:, :covered])
    selected[:, covered:] = float("-inf")
    logits.index_copy_(0, index, selected)
