"""Top-k / top-p / min-p truncation and the inverse-CDF draw on the device, without a sort.

Same semantics as runner/sampler.py's `truncated_probs_batch` and `sample_rows`: divide by the
temperature, keep the tokens at or above the k-th largest value, softmax, keep the smallest set of
most likely tokens whose mass reaches top_p, drop those below min_p x the top probability,
renormalize; then the first token whose cumulative probability (in vocabulary order) reaches
u x the total. Each threshold is found by bisection over the floats' bit patterns (an order-
preserving int32 key), 32 counting passes over the row: exact, where a bisection over values is not.
Ties at a top-p boundary are all kept (a sort would keep some of them, in its own order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _key(x):
    """An int32 whose order is x's (float32) order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _truncate_kernel(
    probs_ptr, logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab,
    stride_probs, stride_logits, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    src = logits_ptr + row * stride_logits
    dst = probs_ptr + row * stride_probs
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    cols = tl.arange(0, BLOCK)
    # pass: the largest scaled logit, and the key range
    high = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        x = tl.load(src + v0 + cols, mask=v0 + cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        high = tl.maximum(high, x)
    top = tl.max(high, axis=0)
    # top-k: the largest key T with count(key >= T) >= k; every key when k is 0 or >= vocab
    lo = (-2147483647 - 1) + tl.zeros([], tl.int64)
    hi = _key(top).to(tl.int64) + 1
    if (top_k > 0) & (top_k < vocab):
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            count = tl.zeros([BLOCK], tl.int32)
            for v0 in range(0, vocab, BLOCK):
                ok = v0 + cols < vocab
                x = tl.load(src + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
                count += (ok & (_key(x).to(tl.int64) >= mid)).to(tl.int32)
            enough = tl.sum(count, axis=0) >= top_k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
    kth = lo
    # softmax over the kept tokens
    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        ok = v0 + cols < vocab
        x = tl.load(src + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        total += tl.where(ok & (_key(x).to(tl.int64) >= kth), tl.exp(x - top), 0.0)
    z = tl.sum(total, axis=0)
    # top-p: the smallest probability key T whose strictly-larger mass is below top_p
    p_lo = tl.zeros([], tl.int64) - 1  # below every probability's key: mass 1 >= top_p
    p_hi = _key(1.0 / z).to(tl.int64)  # the top probability: nothing above it
    if top_p < 1.0:
        for _ in range(33):
            mid = p_lo + (p_hi - p_lo) // 2
            mass = tl.zeros([BLOCK], tl.float32)
            for v0 in range(0, vocab, BLOCK):
                ok = v0 + cols < vocab
                x = tl.load(src + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
                p = tl.where(ok & (_key(x).to(tl.int64) >= kth), tl.exp(x - top) / z, 0.0)
                mass += tl.where(_key(p).to(tl.int64) > mid, p, 0.0)
            below = tl.sum(mass, axis=0) < top_p
            p_hi = tl.where(below, mid, p_hi)
            p_lo = tl.where(below, p_lo, mid)
    else:
        p_hi = p_lo + 1  # keep every probability (keys of p >= 0 are >= 0)
    floor = min_p / z  # min_p x the top probability, exp(0) / z
    kept = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        ok = v0 + cols < vocab
        x = tl.load(src + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.where(ok & (_key(x).to(tl.int64) >= kth), tl.exp(x - top) / z, 0.0)
        p = tl.where((_key(p).to(tl.int64) >= p_hi) & (p >= floor), p, 0.0)
        tl.store(dst + v0 + cols, p, mask=ok)
        kept += p
    norm = tl.sum(kept, axis=0)
    for v0 in range(0, vocab, BLOCK):
        ok = v0 + cols < vocab
        p = tl.load(dst + v0 + cols, mask=ok, other=0.0)
        tl.store(dst + v0 + cols, p / norm, mask=ok)


@triton.jit
def _draw_kernel(tokens_ptr, probs_ptr, uniforms_ptr, vocab, stride_probs, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    src = probs_ptr + row * stride_probs
    cols = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        total += tl.load(src + v0 + cols, mask=v0 + cols < vocab, other=0.0)
    target = tl.load(uniforms_ptr + row) * tl.sum(total, axis=0)
    # the first index whose cumulative probability reaches the target = how many stay below it
    below = tl.zeros([], tl.int32)
    running = tl.zeros([], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        p = tl.load(src + v0 + cols, mask=v0 + cols < vocab, other=0.0)
        cdf = running + tl.cumsum(p, axis=0)
        below += tl.sum(((cdf < target) & (v0 + cols < vocab)).to(tl.int32), axis=0)
        running += tl.sum(p, axis=0)
    index = tl.minimum(below, vocab - 1)
    # rounding may land on a zeroed entry: take the last token at or before it that can be drawn
    last = tl.zeros([], tl.int32)
    for v0 in range(0, vocab, BLOCK):
        p = tl.load(src + v0 + cols, mask=v0 + cols < vocab, other=0.0)
        drawable = (p > 0.0) & (v0 + cols <= index)
        last = tl.maximum(last, tl.max(tl.where(drawable, v0 + cols, 0), axis=0))
    tl.store(tokens_ptr + row, last)


def truncated_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """logits [M, V]; per row temperature, top_p, min_p (float32) and top_k (int32, 0: off)
    -> float32 probabilities [M, V]."""
    rows, vocab = logits.shape
    probs = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows:
        _truncate_kernel[(rows,)](
            probs, logits, temperature, top_k, top_p, min_p, vocab, probs.stride(0), logits.stride(0),
            BLOCK=BLOCK_V,
        )  # fmt: skip
    return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [M, V] float32, uniforms [M] float32 in [0, 1) -> tokens [M] int32."""
    rows, vocab = probs.shape
    tokens = torch.empty(rows, dtype=torch.int32, device=probs.device)
    if rows:
        _draw_kernel[(rows,)](tokens, probs, uniforms, vocab, probs.stride(0), BLOCK=BLOCK_V)
    return tokens
