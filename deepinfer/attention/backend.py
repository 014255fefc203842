"""The attention backend interface and the plain-PyTorch paged attention that is its reference.

A backend owns how K/V are written to and read from the paged cache. The cache of one layer is a
tensor [num_slots, 2, num_kv_heads, head_dim] (K then V per slot) where
slot = block_id * block_size + offset. Every cache in the engine puts the slot axis first, so block
copies and transfers to other tiers are layout-agnostic.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from deepinfer.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step precomputation shared by all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D], cache: [S, 2, KVH, D] -> out [T, H, D]."""


def context_slots(meta: AttentionMetadata, i: int) -> torch.Tensor:
    """Cache slots [L] of the context sequence i's queries see (from `first_key_position`), in
    position order."""
    positions = torch.arange(
        meta.first_key_position(i), meta.seq_lens_list[i], device=meta.block_tables.device
    )
    blocks = meta.block_tables[i, positions // meta.block_size]
    return blocks * meta.block_size + positions % meta.block_size


def attend_sequence(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal attention of q [Q, H, D] over context keys/values [L, KVH, D] (the queries are the
    last Q positions); with a `window`, a query sees only its last `window` positions."""
    num_q, length = q.shape[0], keys.shape[0]
    # Query j sits at context position length - num_q + j and may see keys 0..that position.
    mask = torch.ones(num_q, length, dtype=torch.bool, device=q.device).tril(diagonal=length - num_q)
    if window is not None:
        mask &= ~torch.ones_like(mask).tril(diagonal=length - num_q - window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # [H, Q, D]
    return out.transpose(0, 1)


class OwnAttention:
    """For a model that attends through its own cache reader (DeepSeek-V4's PagedV4Cache): the
    step's metadata needs no backend precomputation, and no layer calls the backend. Its name
    says which kernels the model's own attention and MoE run: "model" (its torch code) or
    "triton" (kernels/triton)."""

    def __init__(self, name: str = "model") -> None:
        self.name = name

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to precompute."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        raise RuntimeError("this model attends through its own cache reader, not an attention backend")


class TorchReferenceBackend:
    """Every sequence attended one by one with SDPA over its gathered context: slow, obviously right."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.extra["slots"] = [context_slots(meta, i) for i in range(meta.num_seqs)]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for i, num_q in enumerate(meta.query_lens):
            slots = meta.extra["slots"][i]
            out[start : start + num_q] = attend_sequence(
                q[start : start + num_q],
                cache[slots, 0].to(q.dtype),
                cache[slots, 1].to(q.dtype),
                scale,
                meta.window,
            )
            start += num_q
        return out


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V [T, KVH, D] at their slots (converted to the cache's dtype)."""
    cache[:, 0].index_copy_(0, slot_mapping, k.to(cache.dtype))
    cache[:, 1].index_copy_(0, slot_mapping, v.to(cache.dtype))
