"""DeepSeek-V4's attention block: one layer type out of sliding / CSA / HCA, with its weights.

Every layer: q LoRA (wq_a, a weighted norm, wq_b), an unweighted RMS norm per query head, one
shared K = V head (wkv, kv_norm), RoPE on the trailing channels, attention over the last W raw
tokens plus a sink logit per head, the inverse RoPE on the output and the grouped output
projection (wo_a per group of heads, then wo_b).
- HCA layers add a compressor (one entry per m tokens) whose entries every query sees once
  complete;
- CSA layers add an overlapping compressor and the lightning indexer (its own compressor at
  index_head_dim, its own query heads from the q LoRA) that picks index_topk complete entries
  per query.
Sliding layers rotate with the main RoPE, compressed layers (and everything in them) with the
compress RoPE. What is kept between steps goes through a V4Cache (see model/deepseek_v4/cache.py).

Tensor parallelism splits the query heads by output group: a rank holds whole groups of heads
(their rows of wq_b, their sinks, their wo_a blocks and wo_b columns), so the grouped output
projection stays local until wo_b's partial sums are all-reduced. Replicated on every rank, and
so is the cache they fill:
- the q LoRA down projection and its norm (wq_a, q_norm): every head, and the indexer, read the
  whole latent;
- the single K = V head (wkv, kv_norm): every query head attends to it, as MLA's latent;
- the compressors: their entries are what every head attends to beyond the window;
- the lightning indexer: every rank must pick the same entries, and a pick ranks scores summed
  over all the indexer's heads. Split heads would need an all-reduce of the [queries, entries]
  scores in every CSA layer, whose sum rounds differently from one process's and could flip a
  pick near a tie; replicated, it costs its few matmuls on every rank and picks exactly what one
  process picks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.cache import CacheKind, StepLayout, V4Cache
from deepinfer.model.deepseek_v4.config import CSA, SLIDING, DeepseekV4Arch
from deepinfer.model.deepseek_v4.norm import Fp32RMSNorm, unweighted_rms_norm
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.sparse import attend_with_sink, indexer_scores, pool_windows, select_entries
from deepinfer.model.deepseek_v4.sparse_triton import attend_with_sink_triton
from deepinfer.model.layers.parallel_linear import Segment
from deepinfer.model.parallel import SINGLE, TensorParallel

# Queries attended per block within a sequence (bounds a long prefill's score tensors).
QUERY_BLOCK = 256


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


class Compressor(torch.nn.Module):
    """Pools every `rate` tokens into one entry of `head_dim` (with overlap: two halves per token)."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = _param(width, hidden_size)
        self.wgate = _param(width, hidden_size)
        self.ape = _param(rate, width)  # position bias of a token within its window
        self.norm = Fp32RMSNorm(head_dim, eps)

    @property
    def state_width(self) -> int:
        return 2 * self.wkv.shape[0]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> per-token state rows [T, state_width]: [kv | gate]."""
        return torch.cat((F.linear(x, self.wkv), F.linear(x, self.wgate)), dim=-1)

    def update(
        self,
        cache: V4Cache,
        seq: int,
        layer: int,
        kinds: tuple[CacheKind, CacheKind],  # (state rows, entries)
        start: int,
        rows: torch.Tensor,  # [n, state_width] of positions start .. start + n - 1
        rope: TrailingRope,
    ) -> None:
        """Stores the step's state rows, then every entry whose window closes in the step."""
        state_kind, entry_kind = kinds
        end = start + rows.shape[0]
        cache.write(seq, layer, state_kind, torch.arange(start, end, device=rows.device), rows)
        first, stop = start // self.rate, end // self.rate  # windows closing at positions start .. end - 1
        if stop <= first:
            return
        lead_window = first - 1 if self.overlap and first > 0 else first
        window_rows = cache.read(
            seq,
            layer,
            state_kind,
            torch.arange(lead_window * self.rate, stop * self.rate, device=rows.device),
        )
        pooled = pool_windows(
            window_rows, self.ape, self.overlap, before_first_window=self.overlap and first == 0
        )
        windows = torch.arange(first, stop, device=rows.device)
        entries = rope(self.norm(pooled), windows * self.rate)
        cache.write(seq, layer, entry_kind, windows, entries)


class Indexer(torch.nn.Module):
    def __init__(self, arch: DeepseekV4Arch, rate: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = arch.index_n_heads, arch.index_head_dim, arch.index_topk
        self.wq_b = _param(arch.index_n_heads * arch.index_head_dim, arch.q_lora_rank)
        self.weights_proj = _param(arch.index_n_heads, arch.hidden_size)
        self.compressor = Compressor(arch.hidden_size, arch.index_head_dim, rate, True, arch.rms_norm_eps)


class V4Attention(torch.nn.Module):
    def __init__(
        self,
        arch: DeepseekV4Arch,
        layer: int,
        main_rope: TrailingRope,
        compress_rope: TrailingRope,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.arch, self.layer, self.tp = arch, layer, tp
        if arch.o_groups < tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} exceeds the model's o_groups={arch.o_groups}: every rank "
                "needs a whole output group of query heads"
            )
        head_dim = arch.head_dim
        group_heads = arch.num_heads // arch.o_groups
        q_rows = Segment.even(arch.num_heads * head_dim, tp, group_heads * head_dim)
        sinks = Segment.even(arch.num_heads, tp, group_heads)
        o_rows = Segment.even(arch.o_groups * arch.o_lora_rank, tp, arch.o_lora_rank)
        self.num_heads = sinks.local  # this rank's heads
        self.num_groups = o_rows.local // arch.o_lora_rank  # and their output groups
        self.wq_a = _param(arch.q_lora_rank, arch.hidden_size)
        self.q_norm = Fp32RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
        self.wq_b = _param(q_rows.local, arch.q_lora_rank)
        self.wkv = _param(head_dim, arch.hidden_size)
        self.kv_norm = Fp32RMSNorm(head_dim, arch.rms_norm_eps)
        self.wo_a = _param(o_rows.local, group_heads * head_dim)
        self.wo_b = _param(arch.hidden_size, o_rows.local)
        self.attn_sink = _param(sinks.local)
        self.splits = {
            "wq_b": (0, [q_rows]),
            "attn_sink": (0, [sinks]),
            "wo_a": (0, [o_rows]),
            "wo_b": (1, [o_rows]),
        }
        kind = arch.layer_type(layer)
        self.rate = arch.compress_rate(layer)
        self.compressor = (
            Compressor(arch.hidden_size, head_dim, self.rate, kind == CSA, arch.rms_norm_eps)
            if self.rate
            else None
        )
        self.indexer = Indexer(arch, self.rate) if kind == CSA else None
        self.rope = main_rope if kind == SLIDING else compress_rope
        self.compress_rope = compress_rope
        self.scale = head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], normed
        positions: torch.Tensor,  # [T]
        layout: StepLayout,
        cache: V4Cache,
        triton: bool = False,  # attend through the Triton kernel (the engine's triton backend)
    ) -> torch.Tensor:  # [T, hidden]
        arch = self.arch
        attend = attend_with_sink_triton if triton else attend_with_sink
        tokens = x.shape[0]
        q_latent = self.q_norm(F.linear(x, self.wq_a))  # [T, q_lora]
        q = F.linear(q_latent, self.wq_b).view(tokens, self.num_heads, arch.head_dim)
        q = self.rope(unweighted_rms_norm(q, arch.rms_norm_eps), positions)
        kv = self.rope(self.kv_norm(F.linear(x, self.wkv)), positions)  # [T, head_dim]
        state = self.compressor.project(x) if self.compressor is not None else None
        index_state = index_q = index_weights = None
        if self.indexer is not None:
            indexer = self.indexer
            index_state = indexer.compressor.project(x)
            index_q = F.linear(q_latent, indexer.wq_b).view(tokens, indexer.num_heads, indexer.head_dim)
            index_q = self.compress_rope(index_q, positions)
            index_weights = F.linear(x, indexer.weights_proj).float() * indexer.num_heads**-0.5
        out = torch.empty_like(q)
        offsets = layout.offsets
        for seq, start in enumerate(layout.starts):
            first, count = offsets[seq], layout.query_lens[seq]
            rows = slice(first, first + count)
            # Everything this step contributes is written first; reads then see it.
            cache.write(seq, self.layer, CacheKind.SLIDING_KV, torch.arange(start, start + count), kv[rows])
            if self.compressor is not None:
                kinds = (CacheKind.COMPRESSOR_STATE, CacheKind.COMPRESSED_KV)
                self.compressor.update(cache, seq, self.layer, kinds, start, state[rows], self.compress_rope)
            if self.indexer is not None:
                kinds = (CacheKind.INDEXER_STATE, CacheKind.INDEXER_KEYS)
                self.indexer.compressor.update(
                    cache, seq, self.layer, kinds, start, index_state[rows], self.compress_rope
                )
            # Queries in blocks: the window part of a long prefill stays [block, block + W] wide.
            for block in range(0, count, QUERY_BLOCK):
                sub = slice(first + block, first + min(block + QUERY_BLOCK, count))
                pos = torch.arange(start + block, start + min(block + QUERY_BLOCK, count), device=x.device)
                keys, mask = self._window(cache, seq, pos)
                if self.indexer is not None:
                    entries, entry_mask = self._picked_entries(
                        cache, seq, pos, index_q[sub], index_weights[sub]
                    )
                    keys, mask = torch.cat((keys, entries)), torch.cat((mask, entry_mask), dim=1)
                elif self.compressor is not None:
                    entries, entry_mask = self._all_entries(cache, seq, pos)
                    keys, mask = torch.cat((keys, entries)), torch.cat((mask, entry_mask), dim=1)
                out[sub] = attend(q[sub], keys, mask, self.attn_sink, self.scale)
        out = self.rope(out, positions, inverse=True)
        return self.tp.all_reduce(F.linear(self._grouped_down(out), self.wo_b))

    def _window(self, cache: V4Cache, seq: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the raw window and which of them each query sees: keys at p - W < j <= p."""
        window = self.arch.sliding_window
        key_pos = torch.arange(max(0, int(pos[0]) - window + 1), int(pos[-1]) + 1, device=pos.device)
        keys = cache.read(seq, self.layer, CacheKind.SLIDING_KV, key_pos)
        distance = pos.unsqueeze(1) - key_pos.unsqueeze(0)
        return keys, (distance >= 0) & (distance < window)

    def _visible(self, pos: torch.Tensor) -> torch.Tensor:
        """Per query, how many entries are complete: window w closes at (w + 1) * m - 1."""
        return (pos + 1) // self.rate

    def _all_entries(self, cache: V4Cache, seq: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = int(pos[-1] + 1) // self.rate
        ids = torch.arange(count, device=pos.device)
        entries = cache.read(seq, self.layer, CacheKind.COMPRESSED_KV, ids)
        return entries, ids.unsqueeze(0) < self._visible(pos).unsqueeze(1)

    def _picked_entries(
        self, cache: V4Cache, seq: int, pos: torch.Tensor, index_q: torch.Tensor, index_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CSA entries the indexer picks: only their union is read from the cache."""
        indexer = self.indexer
        count = int(pos[-1] + 1) // self.rate
        if count == 0:
            empty = torch.zeros((pos.shape[0], 0), dtype=torch.bool, device=pos.device)
            return index_q.new_empty((0, self.arch.head_dim)), empty
        keys = cache.read(seq, self.layer, CacheKind.INDEXER_KEYS, torch.arange(count, device=pos.device))
        scores = indexer_scores(index_q, keys, index_weights, indexer.head_dim**-0.5)
        selected = select_entries(scores, self._visible(pos), indexer.top_k)  # [n, count]
        union = selected.any(dim=0).nonzero().squeeze(1)
        entries = cache.read(seq, self.layer, CacheKind.COMPRESSED_KV, union)
        return entries, selected[:, union]

    def _grouped_down(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [T, G * o_lora] (this rank's H heads in G groups): each group of heads has its
        own wo_a block."""
        groups = self.num_groups
        grouped = out.reshape(out.shape[0], groups, self.wo_a.shape[1]).transpose(0, 1)  # [G, T, H*D/G]
        weight = self.wo_a.view(groups, self.arch.o_lora_rank, -1).transpose(1, 2)  # [G, H*D/G, o_lora]
        return torch.bmm(grouped, weight).transpose(0, 1).flatten(1)
