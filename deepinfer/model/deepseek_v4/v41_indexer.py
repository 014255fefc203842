"""DeepSeek-V4.1's lightning indexer: which compressed entries each query attends.

Per query the indexer scores every compressed entry it can see,
    score(q, e) = sum_h w_h * relu(q_h . k_e),
over its heads h (queries from the q LoRA latent by `wq_b`, head weights from the layer input by
`weights_proj`), and keeps the `index_topk` best. Unlike V4, V4.1 has no compressor of its own
for the keys: they are projected from the layer's main compressor output before RoPE (`wk`,
RMS norm `k_norm`), and a layer may borrow another layer's keys or top-k altogether (the sharing
maps of the config). Both Q and K are held as FP4 (e2m1, one power-of-two UE8M0 scale per 32
channels) on DeepSeek's engine, and its logits are bfloat16; this module reproduces both
roundings in float32 so that its choices match the engine's, ties included.

Causality: compressed entry b covers tokens b*ratio .. b*ratio + ratio - 1, so a query at
position p sees entries 0 .. (p + 1) // ratio - 1 (only windows it has completed).

Two-level top-k (candidate blocks): one layer (the candidate source) groups the entries into
blocks of `block_size`, scores each block by its best visible entry and keeps the
`topk_blocks` best blocks per query, always including the last (possibly partial) block so the
newest entries stay reachable. That layer still picks its own top-k over all entries; every
later indexer layer scores only the entries inside those candidate blocks and picks its top-k
there, which bounds its work by the candidates rather than the context.

Selections are index lists [queries, width] in ascending entry order padded with -1 (as the
engine's top-k kernels write them). Equal scores (ReLU makes exact zeros common, bfloat16 makes
ties common) go to the lower entry or block number, so a query's choice depends only on its own
scores: never on chunking or on which other sequences share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.norm import unweighted_rms_norm
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch

E2M1_MAX = 6.0  # largest magnitude of the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}
FP4_GROUP = 32  # channels sharing one scale in the index Q/K format
# DeepSeek's quantizer clamps a group's amax from below so an all-zero group gets a finite,
# normal scale (2^-126) instead of zero.
_AMAX_FLOOR = E2M1_MAX * 2.0**-126
_BF16_MAX = torch.finfo(torch.bfloat16).max


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


class Rope(Protocol):
    """Rotates the trailing RoPE channels of x [N, ..., D] by the angles of positions [N]."""

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


# --- FP4 emulation -------------------------------------------------------------------------


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the even code), saturating at +-6; NaN saturates too."""
    magnitude = torch.nan_to_num(x.abs(), nan=E2M1_MAX, posinf=E2M1_MAX).clamp(max=E2M1_MAX)
    # The grid is uniform within each binade: steps of 0.5 below 2, 1 below 4, 2 up to 6. In step
    # units the codes are consecutive integers whose parity is the mantissa bit's, so
    # round-half-to-even on magnitude / step is exactly FP4's round-to-nearest-even.
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, x)


def _ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-group scale amax / 6 rounded up to a power of two (UE8M0 stores only an exponent);
    rounding up keeps amax / scale <= 6, so the largest channel never saturates."""
    scale = amax.clamp(min=_AMAX_FLOOR) / E2M1_MAX
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))


def fp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 32) -> float32 values after FP4 quantization and dequantization
    with one UE8M0 scale per 32 consecutive channels, as the index cache and index Q hold them."""
    if x.shape[-1] % FP4_GROUP:
        raise ValueError(f"FP4 index values need a multiple of {FP4_GROUP} channels, not {x.shape[-1]}")
    groups = x.float().unflatten(-1, (-1, FP4_GROUP))  # [..., D / 32, 32]
    scale = _ue8m0_scale(groups.abs().amax(dim=-1, keepdim=True))
    # Dividing by a power of two is exact, so this equals the engine's multiply by 1 / scale.
    return (_round_to_e2m1(groups / scale) * scale).flatten(-2)


# --- scores and visibility -----------------------------------------------------------------


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """positions [n] -> [n] int64: how many compressed entries are complete at each query."""
    return torch.div(positions.long() + 1, ratio, rounding_mode="floor")


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, H, D], weights [n, H], keys [E, D] -> [n, E] bfloat16: sum_h w_h * relu(q_h . k_e),
    accumulated in float32 and rounded once, as the engine's bfloat16 logits are."""
    dots = torch.matmul(q.float(), keys.float().t())  # [n, H, E]
    summed = (F.relu(dots) * weights.float().unsqueeze(-1)).sum(dim=1)
    return summed.to(torch.bfloat16)


# --- selection -----------------------------------------------------------------------------


def top_indices(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """scores [n, E], valid [n, E] bool -> [n, k] int64: per row the k best valid columns
    (equal scores: the lower column first), in ascending column order, -1 where fewer are valid."""
    n, width = scores.shape
    if width == 0:
        return torch.full((n, k), -1, dtype=torch.long, device=scores.device)
    keyed = scores.float().masked_fill(~valid, float("-inf"))
    # A stable descending sort keeps equal scores in column order; valid columns with -inf
    # scores cannot occur (scores are finite), so the first `count` columns are the valid best.
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[:, :k]  # [n, min(k, E)]
    count = valid.sum(dim=-1, keepdim=True)
    ranks = torch.arange(order.shape[1], device=scores.device)
    chosen = torch.where(ranks < count, order, width)  # width sorts after every real column
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == width, -1, chosen)
    return F.pad(chosen, (0, k - chosen.shape[1]), value=-1)


def candidate_block_scores(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [n, E] bfloat16, visible [n] -> (block scores [n, ceil(E / block_size)] bfloat16,
    valid blocks [n] int64). A block scores its best visible entry, capped at the largest finite
    bfloat16 so that only the last valid block, set to +inf, outranks everything: it holds the
    newest entries and is always a candidate. Blocks past the valid ones are -inf."""
    width = scores.shape[1]
    blocks = -(-width // block_size)
    entries = torch.arange(blocks * block_size, device=scores.device)
    padded = F.pad(scores.float(), (0, blocks * block_size - width), value=float("-inf"))
    padded = padded.masked_fill(entries >= visible.unsqueeze(1), float("-inf"))
    block_scores = padded.unflatten(1, (blocks, block_size)).amax(dim=-1).clamp(max=_BF16_MAX)
    valid_blocks = torch.div(visible.long() + block_size - 1, block_size, rounding_mode="floor")
    valid_blocks = valid_blocks.clamp(max=blocks)
    last = (valid_blocks - 1).clamp(min=0).unsqueeze(1)
    newest = block_scores.gather(1, last).masked_fill(valid_blocks.unsqueeze(1) > 0, float("inf"))
    block_scores = block_scores.scatter(1, last, newest)
    return block_scores.to(torch.bfloat16), valid_blocks


def choose_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """scores [n, E] bfloat16 of the candidate source layer -> [n, topk_blocks] int64 block
    numbers in ascending order, -1 padded (a query with fewer valid blocks keeps them all)."""
    block_scores, valid_blocks = candidate_block_scores(scores, visible, block_size)
    blocks = torch.arange(block_scores.shape[1], device=scores.device)
    return top_indices(block_scores, blocks < valid_blocks.unsqueeze(1), topk_blocks)


def candidate_entries(candidates: torch.Tensor, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """candidates [n, T] block numbers (-1: none) -> [n, T * block_size] int64 entry numbers in
    the compact layout (slot i of block j at column j * block_size + i), -1 where the slot is
    no visible entry. With ascending candidates the compact order is the entry order."""
    offsets = torch.arange(block_size, device=candidates.device)
    entries = (candidates.long().unsqueeze(-1) * block_size + offsets).flatten(1)  # [n, T * bs]
    usable = (candidates.unsqueeze(-1) >= 0).expand(-1, -1, block_size).flatten(1)
    usable &= entries < visible.unsqueeze(1)
    return torch.where(usable, entries, -1)


def top_indices_in_candidates(
    scores: torch.Tensor, visible: torch.Tensor, candidates: torch.Tensor, block_size: int, k: int
) -> torch.Tensor:
    """scores [n, E] -> [n, k] int64: the k best visible entries inside each query's candidate
    blocks, ascending, -1 padded. Selection runs on the compact layout as the engine's does
    (ties to the lower compact column, i.e. the lower entry) and maps back to entry numbers."""
    entries = candidate_entries(candidates, visible, block_size)  # [n, C]
    if entries.shape[1] == 0:
        return torch.full((scores.shape[0], k), -1, dtype=torch.long, device=scores.device)
    compact = scores.gather(1, entries.clamp(min=0)) if scores.shape[1] else scores.new_zeros(entries.shape)
    picked = top_indices(compact, entries >= 0, k)
    restored = entries.gather(1, picked.clamp(min=0))
    return torch.where(picked >= 0, restored, -1)


# --- the module ----------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class CandidateRole:
    """A layer's part in the two-level top-k: `produce` (the candidate source) or consume."""

    produce: bool
    topk_blocks: int
    block_size: int


@dataclass(slots=True)
class IndexerSelection:
    """One indexer layer's output for a flattened batch of queries."""

    top: torch.Tensor  # [N, top_k] int64 entry numbers of the query's own sequence, -1 padded
    candidates: torch.Tensor | None  # [N, topk_blocks] int64 blocks, from the candidate source


class V41Indexer(torch.nn.Module):
    """Index queries, keys and the per-query top-k of one V4.1 layer that runs its own indexer.

    Keys are computed once per compressed entry (`keys`, by an index-K source layer; others
    borrow them) and passed back per sequence, so this module never touches the paged cache."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        latent_dim: int,
        num_heads: int,
        head_dim: int,
        top_k: int,
        ratio: int,
        norm_eps: float,
        rope: Rope,
        owns_keys: bool = True,
        candidate: CandidateRole | None = None,
    ) -> None:
        super().__init__()
        if head_dim % FP4_GROUP:
            raise ValueError(f"index_head_dim={head_dim} is not a multiple of the FP4 group {FP4_GROUP}")
        if (
            candidate is not None
            and not candidate.produce
            and candidate.topk_blocks * candidate.block_size < top_k
        ):
            raise ValueError(
                f"{candidate.topk_blocks} candidate blocks of {candidate.block_size} hold fewer than top_k={top_k}"
            )
        self.num_heads, self.head_dim, self.top_k = num_heads, head_dim, top_k
        self.ratio, self.norm_eps, self.rope, self.candidate = ratio, norm_eps, rope, candidate
        self.wq_b = _param(num_heads * head_dim, q_lora_rank)
        self.weights_proj = _param(num_heads, hidden_size)
        self.wk = _param(head_dim, latent_dim) if owns_keys else None
        self.k_norm = _param(head_dim) if owns_keys else None

    @classmethod
    def from_arch(cls, arch: DeepseekV41Arch, layer: int, rope: Rope) -> V41Indexer:
        """The indexer of a layer that runs its own (arch.owns_indexer(layer)); the candidate
        source produces candidate blocks and every later layer's indexer consumes them."""
        if not arch.owns_indexer(layer):
            raise ValueError(
                f"layer {layer} uses layer {arch.index_source[layer]}'s top-k, it has no indexer"
            )
        spec, role = arch.candidate, None
        if spec is not None and layer >= spec.source_layer:
            role = CandidateRole(layer == spec.source_layer, spec.topk_blocks, spec.block_size)
        return cls(
            arch.hidden_size,
            arch.q_lora_rank,
            arch.head_dim,
            arch.index_n_heads,
            arch.index_head_dim,
            arch.index_topk,
            arch.compress_ratio(layer),
            arch.rms_norm_eps,
            rope,
            owns_keys=arch.owns_index_keys(layer),
            candidate=role,
        )

    def keys(self, latent: torch.Tensor, first_entry: int) -> torch.Tensor:
        """latent [m, latent_dim]: the main compressor's normalised pre-RoPE entries numbered
        first_entry .. first_entry + m - 1 -> [m, head_dim] float32 keys as the index cache
        holds them (RoPE at the entry's first token, bfloat16, FP4)."""
        if self.wk is None or self.k_norm is None:
            raise RuntimeError("this layer borrows its index keys from its index-K source layer")
        k = F.linear(latent.float(), self.wk.float())
        k = unweighted_rms_norm(k, self.norm_eps) * self.k_norm.float()
        positions = (torch.arange(latent.shape[0], device=latent.device) + first_entry) * self.ratio
        # The engine's RoPE and quantizer read bfloat16 activations.
        return fp4_round_trip(self.rope(k.to(torch.bfloat16), positions).to(torch.bfloat16))

    def queries(
        self, q_latent: torch.Tensor, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_latent [N, q_lora_rank] (after q_norm), x [N, hidden], positions [N] ->
        (FP4 queries [N, H, D] float32, head weights [N, H] bfloat16 as the engine keeps them)."""
        q = F.linear(q_latent.float(), self.wq_b.float()).unflatten(-1, (self.num_heads, self.head_dim))
        q = self.rope(q.to(torch.bfloat16), positions).to(torch.bfloat16)
        weights = F.linear(x.float(), self.weights_proj.float()).to(torch.bfloat16)
        return fp4_round_trip(q), weights

    def forward(
        self,
        q_latent: torch.Tensor,
        x: torch.Tensor,
        positions: torch.Tensor,
        query_counts: list[int],
        keys: list[torch.Tensor],
        candidates: torch.Tensor | None = None,
    ) -> IndexerSelection:
        """A flattened batch: sequence s owns the next query_counts[s] rows (positions are its
        own) and keys[s] [E_s, D] from `keys`. A consumer of candidate blocks passes the source
        layer's `candidates` rows for the same queries."""
        q, weights = self.queries(q_latent, x, positions)
        return select(
            q, weights, positions, query_counts, keys, self.ratio, self.top_k, self.candidate, candidates
        )


def select(
    q: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    query_counts: list[int],
    keys: list[torch.Tensor],
    ratio: int,
    top_k: int,
    candidate: CandidateRole | None = None,
    candidates: torch.Tensor | None = None,
) -> IndexerSelection:
    """Scores per sequence against its own keys, then one batched selection over rows padded to
    the longest sequence: padding columns are never valid, and every row is ranked alone."""
    if len(query_counts) != len(keys) or sum(query_counts) != q.shape[0]:
        raise ValueError("query_counts and keys must describe the rows of q, one sequence each")
    visible = visible_entries(positions, ratio)
    width = max((k.shape[0] for k in keys), default=0)
    scores = torch.zeros(q.shape[0], width, dtype=torch.bfloat16, device=q.device)
    row = 0
    for count, seq_keys in zip(query_counts, keys, strict=True):
        rows = slice(row, row + count)
        if count and int(visible[rows].max()) > seq_keys.shape[0]:
            raise ValueError(
                f"a query sees {int(visible[rows].max())} entries but {seq_keys.shape[0]} keys were given"
            )
        scores[rows, : seq_keys.shape[0]] = index_scores(q[rows], weights[rows], seq_keys)
        row += count
    valid = torch.arange(width, device=q.device) < visible.unsqueeze(1)
    if candidate is None:
        return IndexerSelection(top_indices(scores, valid, top_k), None)
    if candidate.produce:
        produced = choose_candidate_blocks(scores, visible, candidate.block_size, candidate.topk_blocks)
        return IndexerSelection(top_indices(scores, valid, top_k), produced)
    if candidates is None or candidates.shape[0] != q.shape[0]:
        raise ValueError("a candidate consumer needs the source layer's candidate blocks for every query")
    top = top_indices_in_candidates(scores, visible, candidates, candidate.block_size, top_k)
    return IndexerSelection(top, candidates)
