"""Paged Multi-head Latent Attention (MLA) in plain PyTorch: the reference path for MLA kernels.

The cache of one layer is [num_slots, kv_lora_rank + rope_dim]: per token, the compressed KV
latent (after its RMSNorm) followed by the rotated rope key shared by all heads. Nothing per head
is cached.

- Decode rows (query length 1) use the absorbed form: the query is projected into the latent space
  with W_UK, attention runs over the latent cache as single-KV-head attention of width
  rank + rope_dim, and the attended latent is projected out with W_UV. Only the cache is read.
- Prefill chunks expand keys and values from the latent of their whole context (earlier chunks come
  from the cache), where one GEMM over the context is cheaper than absorbing every query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class PrefillChunk:
    query_start: int
    query_len: int
    slots: torch.Tensor  # [L] cache slots of the sequence's whole context, in position order


@dataclass(slots=True)
class MLAStepMetadata:
    """Per-step gather indices, built once per forward and shared by every MLA layer."""

    num_decodes: int
    decode_slots: torch.Tensor  # [D, Lmax] context slots of each decode row (padding: block 0, masked)
    decode_mask: torch.Tensor  # [D, 1, 1, Lmax] bool: True where a row may attend
    prefills: list[PrefillChunk]
    # decode rows through the Triton kernel (kernels/triton/mla_decode.py), routed experts through
    # the fused MoE (kernels/triton/fused_moe.py)
    triton: bool = False

    @classmethod
    def build(cls, meta: AttentionMetadata, triton: bool = False) -> MLAStepMetadata:
        d = meta.num_decodes
        tables, bs = meta.block_tables, meta.block_size
        if d:
            max_len = max(meta.seq_lens_list[:d])
            positions = torch.arange(max_len, device=tables.device)
            decode_slots = tables[:d, positions // bs] * bs + positions % bs  # [D, Lmax]
            decode_mask = (positions < meta.seq_lens[:d, None]).view(d, 1, 1, max_len)
        else:
            decode_slots = torch.zeros(0, 0, dtype=torch.long, device=tables.device)
            decode_mask = torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=tables.device)
        prefills = []
        start = d
        for i in range(d, meta.num_seqs):
            positions = torch.arange(meta.seq_lens_list[i], device=tables.device)
            slots = tables[i, positions // bs] * bs + positions % bs
            prefills.append(PrefillChunk(start, meta.query_lens[i], slots))
            start += meta.query_lens[i]
        return cls(d, decode_slots, decode_mask, prefills, triton)


def write_latent(
    cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent [T, rank], k_rope [T, rope_dim] -> cache rows slot_mapping."""
    cache.index_copy_(0, slot_mapping, torch.cat([latent, k_rope], dim=-1).to(cache.dtype))


def mla_decode(
    q_nope: torch.Tensor,  # [D, H, nope]
    q_rope: torch.Tensor,  # [D, H, rope]
    cache: torch.Tensor,  # [S, rank + rope]
    w_uk: torch.Tensor,  # [H, nope, rank]
    w_uv: torch.Tensor,  # [H, v, rank]
    step: MLAStepMetadata,
    scale: float,
) -> torch.Tensor:  # [D, H, v]
    rank = w_uk.shape[-1]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, H, rank]
    query = torch.cat([q_latent, q_rope], dim=-1).unsqueeze(1)  # [D, 1, H, rank + rope]
    context = cache[step.decode_slots].unsqueeze(1)  # [D, 1, Lmax, rank + rope]
    # Single KV head: the H query heads sit in the sequence axis and all see the same latent keys.
    out_latent = F.scaled_dot_product_attention(
        query, context, context[..., :rank], attn_mask=step.decode_mask, scale=scale
    )  # [D, 1, H, rank]
    return torch.bmm(out_latent.squeeze(1).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _mla_decode_triton(
    q_nope: torch.Tensor,  # [D, H, nope]
    q_rope: torch.Tensor,  # [D, H, rope]
    cache: torch.Tensor,  # [S, rank + rope]
    w_uk: torch.Tensor,  # [H, nope, rank]
    w_uv: torch.Tensor,  # [H, v, rank]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [D, H, v]
    """mla_decode with the attention over the latent cache in the Triton kernel (read through the
    block table, no gathered copy of the context)."""
    from deepinfer.kernels.triton.mla_decode import mla_decode_latent

    d, rank = q_nope.shape[0], w_uk.shape[-1]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, H, rank]
    query = torch.cat([q_latent, q_rope], dim=-1)  # [D, H, rank + rope]
    out_latent = mla_decode_latent(
        query, cache, rank, meta.block_tables[:d], meta.seq_lens[:d], meta.block_size, scale
    )  # [D, H, rank]
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_prefill(
    q_nope: torch.Tensor,  # [Q, H, nope]
    q_rope: torch.Tensor,  # [Q, H, rope]
    cache: torch.Tensor,  # [S, rank + rope]
    kv_b_weight: torch.Tensor,  # [H * (nope + v), rank]
    slots: torch.Tensor,  # [L]
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [Q, H, v]
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = kv_b_weight.shape[1]
    context = cache[slots]  # [L, rank + rope]
    kv = F.linear(context[:, :rank], kv_b_weight).view(-1, num_heads, nope + v_head_dim)
    k_nope, values = kv.split([nope, v_head_dim], dim=-1)
    k_rope = context[:, rank:].unsqueeze(1).expand(-1, num_heads, -1)
    keys = torch.cat([k_nope, k_rope], dim=-1)  # [L, H, nope + rope]
    query = torch.cat([q_nope, q_rope], dim=-1)  # [Q, H, nope + rope]
    num_q, length = query.shape[0], keys.shape[0]
    # Query j sits at context position length - num_q + j and sees keys 0..that position.
    causal = torch.ones(num_q, length, dtype=torch.bool, device=query.device).tril(diagonal=length - num_q)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=causal, scale=scale
    )  # [H, Q, v]
    return out.transpose(0, 1)


def mla_attention(
    q_nope: torch.Tensor,  # [T, H, nope]
    q_rope: torch.Tensor,  # [T, H, rope] (rotated)
    latent: torch.Tensor,  # [T, rank] (normed)
    k_rope: torch.Tensor,  # [T, rope] (rotated)
    cache: torch.Tensor,
    kv_b_weight: torch.Tensor,  # [H * (nope + v), rank]
    v_head_dim: int,
    meta: AttentionMetadata,
    step: MLAStepMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, v]
    """Write this step's latents, then attend every row over its sequence's cached context."""
    write_latent(cache, latent, k_rope, meta.slot_mapping)
    num_tokens, num_heads, nope = q_nope.shape
    out = q_nope.new_empty(num_tokens, num_heads, v_head_dim)
    d = step.num_decodes
    if d:
        w_kv = kv_b_weight.view(num_heads, nope + v_head_dim, -1)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        if step.triton:
            out[:d] = _mla_decode_triton(q_nope[:d], q_rope[:d], cache, w_uk, w_uv, meta, scale)
        else:
            out[:d] = mla_decode(q_nope[:d], q_rope[:d], cache, w_uk, w_uv, step, scale)
    for chunk in step.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = mla_prefill(
            q_nope[rows], q_rope[rows], cache, kv_b_weight, chunk.slots, v_head_dim, scale
        )
    return out
