"""Grammar bitmasks applied on the device: disallowed tokens to -inf (structured/bitmask.py's
layout: int32 words, token t allowed when bit t % 32 of word t // 32 is set)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, vocab, words, stride_logits, stride_mask, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = t < vocab
    covered = t < words * 32  # columns past the bitmask have no text: disallowed
    word = tl.load(bitmask_ptr + i * stride_mask + t // 32, mask=in_vocab & covered, other=0)
    allowed = ((word >> (t % 32)) & 1) != 0
    ptr = logits_ptr + row * stride_logits + t
    logits = tl.load(ptr, mask=in_vocab, other=0.0)
    tl.store(ptr, tl.where(allowed, logits, float("-inf")), mask=in_vocab)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [B, V] in place; bitmask [N, W] int32 on the logits' device; rows [N] int64: the
    logits row each bitmask row constrains. Returns logits."""
    n, words = bitmask.shape
    vocab = logits.shape[1]
    if n:
        _bitmask_kernel[(n, triton.cdiv(vocab, BLOCK_V))](
            logits, bitmask, rows, vocab, words, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK_V
        )
    return logits
