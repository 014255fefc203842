"""DeepSeek-V4.1's KV compressors: C1 (one entry per token) and C2 (one per two tokens).

From a layer's attention input x, the compressor projects a latent (`compressor.wkv`) and, for
C2, per-channel gate logits (`compressor.wgate`). Every `ratio` consecutive tokens (positions
b*ratio .. b*ratio + ratio - 1) become entry b: the latents weighted by the softmax of their
gate logits over those tokens, channel by channel. C1's softmax over one token is 1, so its
entry is the latent itself and it has no gate. Entries are RMS-normalised (`compressor.norm`)
before RoPE; the pre-RoPE entries are what the indexer projects its keys from.

A chunk of new tokens can end inside a block, so C2 keeps a ring of the last S tokens' (logits,
latent) per sequence, position p in slot p % S, and the next chunk completes the block from it.
S = ratio + backtrack - 1 keeps a block's earlier tokens even after the last `backtrack` tokens
are rolled back (rejected draft tokens) and recomputed, so a rewound sequence compresses as if
it had never seen them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.norm import unweighted_rms_norm


def ring_size(ratio: int, backtrack: int) -> int:
    """State slots a C2 sequence needs to allow rolling back `backtrack` tokens (>= 1)."""
    return ratio + max(backtrack, 1) - 1


def compress_chunk(
    latent: torch.Tensor, logits: torch.Tensor | None, state: torch.Tensor | None, start: int, ratio: int
) -> torch.Tensor:
    """One sequence's chunk: latent, logits [n, D] fp32 at positions start .. start + n - 1;
    state [S, 2, D] (logits, latent) of its earlier tokens at slot p % S, or None for C1.
    Returns the entries of the blocks this chunk completes [m, D]; writes the chunk's last
    min(n, S) tokens into state (mutates state)."""
    if ratio == 1:
        if logits is not None or state is not None:
            raise ValueError("C1 has no gate and no state: every token is its own entry")
        return latent.clone()
    if logits is None or state is None:
        raise ValueError(f"C{ratio} needs the gate logits and the ring state")
    size, n = state.shape[0], latent.shape[0]
    if size < ratio:
        raise ValueError(f"a ring of {size} slots cannot hold a block of {ratio} tokens")
    if n == 0:
        return latent.new_zeros(0, latent.shape[1])
    carried = start % ratio  # tokens of the open block that earlier chunks saw
    slots = torch.arange(start - carried, start) % size
    all_logits = torch.cat([state[slots, 0], logits])  # [carried + n, D]
    all_latent = torch.cat([state[slots, 1], latent])
    blocks = (carried + n) // ratio
    used = blocks * ratio
    weights = torch.softmax(all_logits[:used].unflatten(0, (blocks, ratio)), dim=1)  # [m, ratio, D]
    entries = (weights * all_latent[:used].unflatten(0, (blocks, ratio))).sum(dim=1)
    kept = min(n, size)
    written = torch.arange(start + n - kept, start + n) % size
    state[written, 0] = logits[n - kept :]
    state[written, 1] = latent[n - kept :]
    return entries


class Compressor(torch.nn.Module):
    """Projection, compression and norm of one compressed layer (the layer owning its KV)."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, norm_eps: float) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"DeepSeek-V4.1 compresses by 1 or 2 tokens per entry, not {ratio}")
        self.ratio, self.norm_eps = ratio, norm_eps
        self.wkv = torch.nn.Parameter(torch.empty(head_dim, hidden_size), requires_grad=False)
        self.wgate = (
            torch.nn.Parameter(torch.empty(head_dim, hidden_size), requires_grad=False)
            if ratio == 2
            else None
        )
        self.norm = torch.nn.Parameter(torch.empty(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, start: int, state: torch.Tensor | None) -> torch.Tensor:
        """x [n, hidden] of one sequence from position `start` -> normalised pre-RoPE entries
        [m, head_dim] of the blocks completed (mutates state, C2 only)."""
        latent = F.linear(x.float(), self.wkv.float())
        logits = F.linear(x.float(), self.wgate.float()) if self.wgate is not None else None
        entries = compress_chunk(latent, logits, state, start, self.ratio)
        return unweighted_rms_norm(entries, self.norm_eps) * self.norm.float()
