"""DeepSeek-V4's kept state on the engine's paged cache groups.

Each declared (layer, kind) of model/deepseek_v4/cache.py is one tensor [num_slots, width] of a cache
group (model/deepseek_v4/model.py decides which): the windowed kinds (sliding KV, compressor and indexer
state, one row per token) live in sliding groups whose window is the kind's lookback + 1; the
compressed kinds (compressed KV, indexer keys, one entry per m tokens) in the compressed group of
rate m. A logical index i (a position, or an entry number) of sequence s maps to

    slot = table_s[i // entries_per_block] * entries_per_block + i % entries_per_block

through the step's block table of that group. The KV manager releases sliding blocks once no
later step's lookback reaches them (their table entries then read as block 0), so every read is
checked against the declaration's lookback: stale rows are an error, never data.

What a block keeps, and why a prefix hit needs nothing else:
- a sliding-group block: the rows of `block_size` consecutive positions of every kind in the
  group (raw K = V; the compressors' and the indexer's raw [kv | gate] projections). The
  compressor state at a boundary is not a snapshot: it is those rows of the not-yet-pooled
  positions, so it is kept as sliding-window KV (vLLM keeps Mamba-like state the same way). A
  hit of L tokens needs positions L - window + 1 .. L - 1 of each group, exactly the lookback
  of its kinds; the manager's SlidingWindowGroup accepts a hit only when those blocks are still
  indexed (blocks released out of the window stay indexed until evicted).
- a compressed-group block: `entries_per_block` finished entries (CSA entries with their indexer
  keys, or HCA entries), indexed like full attention once every token they pool is computed.
  Every hit length is a multiple of the lcm of the groups' block tokens (the manager's
  hit_granularity), hence of every compress rate: at a hit no compression window is open, and
  every entry before it is complete and cached. A hit cannot end inside a compression window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.model.deepseek_v4.cache import CacheDecl, CacheKind, StepLayout


@dataclass(slots=True, frozen=True)
class PagedTensor:
    """Where one declared (layer, kind) lives: its tensor and its group in the step metadata."""

    decl: CacheDecl
    tensor: torch.Tensor  # [num_slots, width]
    group: int  # index into ForwardMetadata.groups


def step_layout(meta: ForwardMetadata) -> StepLayout:
    """The step's sequences in the runner's flattened order (decodes first)."""
    first = meta.groups[0]
    return StepLayout.from_lengths(first.query_lens, first.seq_lens_list)


class PagedV4Cache:
    """The V4Cache of one step over the engine's paged groups (read and write per sequence)."""

    def __init__(
        self, tensors: dict[tuple[int, CacheKind], PagedTensor], meta: ForwardMetadata, layout: StepLayout
    ) -> None:
        self.tensors, self.meta, self.layout = tensors, meta, layout

    def _slots(self, seq: int, paged: PagedTensor, index: torch.Tensor) -> torch.Tensor:
        group = self.meta.groups[paged.group]
        per_block = group.block_size
        table = group.block_tables[seq]
        return table[index // per_block] * per_block + index % per_block

    def _placed(self, layer: int, kind: CacheKind) -> PagedTensor:
        paged = self.tensors.get((layer, kind))
        if paged is None:
            raise KeyError(f"layer {layer} declares no {kind.value} cache")
        return paged

    def read(self, seq: int, layer: int, kind: CacheKind, index: torch.Tensor) -> torch.Tensor:
        """Rows [len(index), width]; mutates nothing. Raises for rows outside the declaration's
        reach (past the step's last token, or before its lookback: possibly released)."""
        paged = self._placed(layer, kind)
        if index.numel() == 0:
            return paged.tensor.new_empty((0, paged.decl.width))
        start = self.layout.starts[seq]
        end = start + self.layout.query_lens[seq]
        low, high = int(index.min()), int(index.max())
        lookback = paged.decl.lookback
        if high >= end // paged.decl.tokens_per_row or (lookback is not None and low < start - lookback):
            raise RuntimeError(
                f"layer {layer} {kind.value}: a step at positions {start}..{end - 1} read rows {low}..{high}, "
                f"outside what the declaration allows (lookback {lookback})"
            )
        return paged.tensor[self._slots(seq, paged, index)]

    def write(self, seq: int, layer: int, kind: CacheKind, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores rows [len(index), width] into the sequence's slots at `index`."""
        paged = self._placed(layer, kind)
        if index.numel() == 0:
            return
        if rows.shape != (index.numel(), paged.decl.width):
            raise ValueError(
                f"layer {layer} {kind.value}: rows {tuple(rows.shape)} for {index.numel()} indices "
                f"of width {paged.decl.width}"
            )
        paged.tensor[self._slots(seq, paged, index)] = rows.to(paged.tensor.dtype)
