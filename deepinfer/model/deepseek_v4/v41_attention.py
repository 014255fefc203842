"""DeepSeek-V4.1's attention block: a sliding window, plus C1 / C2 compressed entries picked by top-k.

Every layer: q LoRA (wq_a, a weighted norm, wq_b) with no per-head query norm (DeepSeek's engine
runs V4.1 with `use_qnorm` off, unlike V4), one shared K = V head (wkv, kv_norm) from the layer's
own input, RoPE on the trailing channels, attention over the last W raw tokens plus a sink
logit per head, the inverse RoPE on the output and the grouped output projection (wo_a per
group of heads, then wo_b), as V4's (layers/v4_attention.py).

A compressed layer (ratio 1 or 2) also attends `index_topk` of its compressed entries per query
(entry b pools tokens b*ratio .. b*ratio + ratio - 1, RoPE at its first token). Which layer
provides what (the config's sharing maps, `CrossLayer` carries it within a step):
- the compressed KV comes from the layer's KV source, the only layer holding the compressor;
  past the YoCo boundary that compressor reads the boundary layer's attention input (the
  shared hidden), not its own, so every later KV depends only on the layers before the boundary;
- the top-k comes from the layer's index source, whose indexer scores queries of that layer
  against the index keys of its index-K source; an index-K source projects its keys from the
  pre-RoPE entries its KV source compressed in the same step;
- after the candidate source, every indexer picks inside the source's candidate blocks.
Compressed layers rotate with the compress RoPE (YaRN), sliding-only layers with the main one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.norm import Fp32RMSNorm
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.sparse import attend_with_sink
from deepinfer.model.deepseek_v4.v41_cache import V41StepView
from deepinfer.model.deepseek_v4.v41_compressor import Compressor
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_indexer import V41Indexer
from deepinfer.model.deepseek_v4.yoco import BoundedReplay

# Queries attended per block within a sequence (bounds a long prefill's score tensors).
QUERY_BLOCK = 256


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


@dataclass
class CrossLayer:
    """What a source layer hands to later layers within one step. Sharing segments are
    contiguous, so each value is the one the nearest source before the reader wrote."""

    shared_hidden: torch.Tensor | None = None  # [T, hidden]: the YoCo boundary's attention input
    pre_rope: list[tuple[int, torch.Tensor]] | None = None  # per sequence: (first entry, [m, head_dim])
    top: torch.Tensor | None = None  # [T, index_topk] entry numbers, -1 padded
    candidates: torch.Tensor | None = None  # [T, candidate_topk_blocks] from the candidate source
    # Bounded replay (model/deepseek_v4/yoco.py), set from the YoCo boundary on: those layers run its kept
    # rows (T above is then theirs), windows clipped to its floors; compressors read every row.
    replay: BoundedReplay | None = None


class V41Attention(torch.nn.Module):
    def __init__(self, arch: DeepseekV41Arch, layer: int, rope: TrailingRope) -> None:
        super().__init__()
        self.arch, self.layer, self.rope = arch, layer, rope
        head_dim = arch.head_dim
        self.num_heads, self.head_dim = arch.num_heads, head_dim
        self.wq_a = _param(arch.q_lora_rank, arch.hidden_size)
        self.q_norm = Fp32RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
        self.wq_b = _param(arch.num_heads * head_dim, arch.q_lora_rank)
        self.wkv = _param(head_dim, arch.hidden_size)
        self.kv_norm = Fp32RMSNorm(head_dim, arch.rms_norm_eps)
        self.wo_a = _param(arch.o_groups * arch.o_lora_rank, arch.num_heads // arch.o_groups * head_dim)
        self.wo_b = _param(arch.hidden_size, arch.o_groups * arch.o_lora_rank)
        self.attn_sink = _param(arch.num_heads)
        self.ratio = arch.compress_ratio(layer)
        self.compressor = (
            Compressor(arch.hidden_size, head_dim, self.ratio, arch.rms_norm_eps)
            if arch.owns_compressor(layer)
            else None
        )
        self.indexer = V41Indexer.from_arch(arch, layer, rope) if arch.owns_indexer(layer) else None
        self.kv_source = arch.kv_source[layer]
        self.index_k_source = arch.index_k_source[layer]
        boundary = arch.yoco_boundary
        self.compresses_shared_hidden = (
            self.compressor is not None and boundary is not None and layer > boundary
        )
        self.scale = head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], normed
        positions: torch.Tensor,  # [T]
        layout: StepLayout,
        step: V41StepView,
        shared: CrossLayer,
    ) -> torch.Tensor:  # [T, hidden]
        tokens = x.shape[0]
        q_latent = self.q_norm(F.linear(x, self.wq_a))  # [T, q_lora]
        q = F.linear(q_latent, self.wq_b).view(tokens, self.num_heads, self.head_dim)
        q = self.rope(q, positions)
        kv = self.rope(self.kv_norm(F.linear(x, self.wkv)), positions)  # [T, head_dim]
        offsets = layout.offsets
        floors = self._floors(shared, layout)
        for seq, (start, floor) in enumerate(zip(layout.starts, floors, strict=True)):
            # a replay's placeholder row (before its floor) is never read: not stored
            skip = min(max(floor - start, 0), layout.query_lens[seq])
            step.write_sliding(seq, self.layer, start + skip, kv[offsets[seq] + skip : offsets[seq + 1]])
        top = None
        if self.ratio:
            if self.compressor is not None:
                # Under bounded replay `x` holds the kept rows only, the boundary's too: every
                # compressor from the boundary on reads the shared hidden (the boundary's own
                # input, every row).
                replay = shared.replay
                source = shared.shared_hidden if self.compresses_shared_hidden or replay is not None else x
                if source is None:
                    raise RuntimeError(f"layer {self.layer}: the YoCo shared hidden was not captured")
                source_layout = layout if replay is None else replay.full_layout
                shared.pre_rope = self._compress(source, source_layout, step)
            if self.indexer is not None:
                self._select(q_latent, x, positions, layout, step, shared)
            top = shared.top
            if top is None:
                raise RuntimeError(f"layer {self.layer}: its index source left no top-k")
        out = torch.empty_like(q)
        for seq, start in enumerate(layout.starts):
            for block in range(0, layout.query_lens[seq], QUERY_BLOCK):
                count = min(QUERY_BLOCK, layout.query_lens[seq] - block)
                rows = slice(offsets[seq] + block, offsets[seq] + block + count)
                pos = torch.arange(start + block, start + block + count, device=x.device)
                keys, mask = self._window(step, seq, pos, floors[seq])
                if top is not None:
                    entries, entry_mask = self._picked(step, seq, top[rows])
                    keys, mask = torch.cat((keys, entries)), torch.cat((mask, entry_mask), dim=1)
                out[rows] = attend_with_sink(q[rows], keys, mask, self.attn_sink, self.scale)
        out = self.rope(out, positions, inverse=True)
        return F.linear(self._grouped_down(out), self.wo_b)

    def _compress(
        self, source: torch.Tensor, layout: StepLayout, step: V41StepView
    ) -> list[tuple[int, torch.Tensor]]:
        """Compresses each sequence's chunk, stores the post-RoPE entries it completes and returns
        them before RoPE (what index keys are projected from)."""
        pre_rope = []
        offsets = layout.offsets
        for seq, start in enumerate(layout.starts):
            chunk = source[offsets[seq] : offsets[seq + 1]]
            entries = self.compressor(chunk, start, step.ring(seq, self.layer))  # [m, head_dim]
            first = start // self.ratio
            numbers = torch.arange(first, first + entries.shape[0], device=source.device)
            step.write_entries(seq, self.layer, first, self.rope(entries, numbers * self.ratio))
            pre_rope.append((first, entries))
        return pre_rope

    def _select(
        self,
        q_latent: torch.Tensor,
        x: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        step: V41StepView,
        shared: CrossLayer,
    ) -> None:
        """This layer's own top-k (and, at the candidate source, the candidate blocks)."""
        indexer = self.indexer
        if indexer.wk is not None:
            if shared.pre_rope is None:
                raise RuntimeError(f"layer {self.layer}: its KV source left no entries for the index keys")
            for seq, (first, entries) in enumerate(shared.pre_rope):
                step.write_index_keys(seq, self.layer, first, indexer.keys(entries, first))
        keys = [step.index_keys(seq, self.index_k_source) for seq in range(len(layout.starts))]
        role = indexer.candidate
        candidates = shared.candidates if role is not None and not role.produce else None
        selection = indexer(q_latent, x, positions, list(layout.query_lens), keys, candidates)
        if role is not None and role.produce:
            shared.candidates = selection.candidates
        shared.top = selection.top

    @staticmethod
    def _floors(shared: CrossLayer, layout: StepLayout) -> tuple[int, ...]:
        """Per sequence, the first position this layer's windows may read (0: unclipped)."""
        return shared.replay.floors if shared.replay is not None else (0,) * len(layout.starts)

    def _window(
        self, step: V41StepView, seq: int, pos: torch.Tensor, floor: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the raw window and which of them each query sees: keys at p - W < j <= p and
        j >= floor (a query before the floor, a replay's placeholder, sees none)."""
        window = self.arch.sliding_window
        first, last = max(0, floor, int(pos[0]) - window + 1), int(pos[-1])
        if first > last:
            keys = torch.zeros((0, self.head_dim), device=pos.device)
            return keys, torch.zeros((pos.shape[0], 0), dtype=torch.bool, device=pos.device)
        keys = step.sliding(seq, self.layer, first, last)
        key_pos = torch.arange(first, last + 1, device=pos.device)
        distance = pos.unsqueeze(1) - key_pos.unsqueeze(0)
        return keys, (distance >= 0) & (distance < window)

    def _picked(self, step: V41StepView, seq: int, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """top [n, k] entry numbers (-1: none) -> the union of the picked entries [U, head_dim]
        (read once from the KV source) and which of them each query sees [n, U]."""
        picked = top >= 0
        union = torch.unique(top[picked])  # sorted
        entries = step.entries(seq, self.kv_source, union)
        columns = torch.searchsorted(union, top.clamp(min=0))  # where each pick sits in the union
        mask = torch.zeros((top.shape[0], union.shape[0] + 1), dtype=torch.bool, device=top.device)
        # A -1 goes to the spare last column, dropped: only real picks mark their entry.
        mask.scatter_(1, torch.where(picked, columns, union.shape[0]), True)
        return entries, mask[:, :-1]

    def _grouped_down(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [T, G * o_lora]: each group of heads has its own wo_a block."""
        groups = self.arch.o_groups
        grouped = out.reshape(out.shape[0], groups, self.wo_a.shape[1]).transpose(0, 1)  # [G, T, H*D/G]
        weight = self.wo_a.view(groups, self.arch.o_lora_rank, -1).transpose(1, 2)  # [G, H*D/G, o_lora]
        return torch.bmm(grouped, weight).transpose(0, 1).flatten(1)
