"""The math of DeepSeek-V4's attention, on tensors of one sequence (no cache access here).

- `attend_with_sink`: shared-KV multi-query attention (the key is the value) of queries over a
  set of rows under a per-query mask, with a learned per-head sink logit in the softmax
  denominator (the rows' weights may sum to less than 1).
- `pool_windows`: a compressor's entries from its per-token [kv | gate] rows: per channel, a
  softmax over the window of gate + position bias weights the kv rows. With overlap (CSA and its
  indexer) each row has two halves and entry w pools the first half of window w - 1 with the
  second half of window w (2m rows, stride m); before the first window there is nothing (weight 0).
- `indexer_scores` / `select_entries`: the lightning indexer's per-query scores
  sum_h w_h * relu(q_h . k) over compressed keys, and the top-k visible entries they pick
  (ties broken towards the older entry, so chunking and batching never change the choice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_with_sink(
    q: torch.Tensor,  # [n, H, D]
    kv: torch.Tensor,  # [L, D]: keys and values
    mask: torch.Tensor,  # [n, L] bool: which rows each query sees
    sinks: torch.Tensor,  # [H] logits of the sink
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    logits = torch.matmul(q.float(), kv.float().t()) * scale  # [n, H, L]
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, kv.float()).to(q.dtype)


def pool_windows(
    rows: torch.Tensor,  # [R, 2 * C * d]: [kv | gate] per token, C = 2 with overlap, R = windows * m
    position_bias: torch.Tensor,  # [m, C * d]
    overlap: bool,
    before_first_window: bool,  # overlap only: rows start at window 0, nothing precedes it
) -> torch.Tensor:  # [windows, d] (overlap: windows = R / m - 1, or R / m when before_first_window)
    rate, width = position_bias.shape
    kv, gate = rows.split(width, dim=-1)
    kv = kv.unflatten(0, (-1, rate))  # [W, m, C * d]
    gate = gate.unflatten(0, (-1, rate)) + position_bias
    if not overlap:
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return (kv * weights).sum(dim=1)
    if before_first_window:
        kv = torch.cat((kv.new_zeros((1, rate, width)), kv))
        gate = torch.cat((gate.new_full((1, rate, width), float("-inf")), gate))
    half = width // 2
    slots_kv = torch.cat((kv[:-1, :, :half], kv[1:, :, half:]), dim=1)  # [windows, 2m, d]
    slots_gate = torch.cat((gate[:-1, :, :half], gate[1:, :, half:]), dim=1)
    weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (slots_kv * weights).sum(dim=1)


def indexer_scores(
    q: torch.Tensor,  # [n, H_I, d_I]
    keys: torch.Tensor,  # [E, d_I]
    head_weights: torch.Tensor,  # [n, H_I] float32
    softmax_scale: float,
) -> torch.Tensor:  # [n, E] float32
    scores = F.relu(torch.matmul(q.float(), keys.float().t())) * softmax_scale  # [n, H_I, E]
    return (scores * head_weights.unsqueeze(-1)).sum(dim=1)


def select_entries(
    scores: torch.Tensor,  # [n, E]
    visible: torch.Tensor,  # [n] int64: entries 0 .. visible - 1 are complete for each query
    top_k: int,
) -> torch.Tensor:  # [n, E] bool: the min(top_k, visible) entries each query attends
    """Top-k by score among the visible entries; equal scores (ReLU makes exact zeros common)
    resolve to the lower entry number, so the choice never depends on how a step is batched."""
    entries = torch.arange(scores.shape[1], device=scores.device)
    visible_mask = entries.unsqueeze(0) < visible.unsqueeze(1)
    scores = scores.masked_fill(~visible_mask, float("-inf"))
    threshold = scores.topk(min(top_k, scores.shape[1]), dim=-1).values[:, -1:]  # k-th best score
    above = (scores > threshold) & visible_mask
    tied = (scores == threshold) & visible_mask
    room = top_k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))
