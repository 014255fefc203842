"""The contiguous store of DeepSeek-V4's kept state: per sequence, one growing tensor per declared
(layer, kind). Only tests use it: the paged store (deepinfer/model/deepseek_v4/paged.py) must agree
with it."""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.cache import CacheDecl, CacheKind, StepLayout, V4Cache


class ContiguousV4Cache:
    """Per sequence, one growing [rows, width] tensor per declared (layer, kind): the simple store
    the paged one must agree with. Reads are checked against the declarations: a step reading a
    row not held (never written, released, rolled back) or one outside its kind's lookback raises
    instead of returning stale data."""

    def __init__(self, decls: list[CacheDecl], dtype: torch.dtype, device: torch.device) -> None:
        self.decls = {(d.layer, d.kind): d for d in decls}
        self.dtype, self.device = dtype, device
        self._tensors: dict[int, dict[tuple[int, CacheKind], torch.Tensor]] = {}
        self._written: dict[int, dict[tuple[int, CacheKind], torch.Tensor]] = {}
        self._next_id = 0

    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._tensors[seq_id] = {}
        self._written[seq_id] = {}
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        del self._tensors[seq_id], self._written[seq_id]

    def release(self, seq_id: int, num_tokens: int) -> None:
        """With num_tokens computed, drop the rows no later step reads (what falls out of a
        windowed kind's lookback), as a paged cache frees such blocks."""
        for key, written in self._written[seq_id].items():
            lookback = self.decls[key].lookback
            if lookback is not None:
                written[: max(0, num_tokens - lookback)] = False

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget everything at or beyond token num_tokens (speculative rollback)."""
        for key, written in self._written[seq_id].items():
            written[num_tokens // self.decls[key].tokens_per_row :] = False

    def step(self, seq_ids: list[int], layout: StepLayout) -> V4Cache:
        if len(seq_ids) != len(layout.starts):
            raise ValueError(f"{len(seq_ids)} sequences for a step layout of {len(layout.starts)}")
        return _ContiguousStep(self, seq_ids, layout)

    def bytes_in_use(self, seq_id: int) -> int:
        """Bytes of rows currently written for one sequence."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return sum(
            int(written.sum()) * self.decls[key].width * element
            for key, written in self._written[seq_id].items()
        )

    def _store(
        self, seq_id: int, key: tuple[int, CacheKind], needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tensors, written = self._tensors[seq_id], self._written[seq_id]
        if key not in tensors:
            tensors[key] = torch.zeros((0, self.decls[key].width), dtype=self.dtype, device=self.device)
            written[key] = torch.zeros(0, dtype=torch.bool, device=self.device)
        if needed > tensors[key].shape[0]:
            capacity = max(needed, 2 * tensors[key].shape[0], 16)
            grown = torch.zeros((capacity, self.decls[key].width), dtype=self.dtype, device=self.device)
            grown[: tensors[key].shape[0]] = tensors[key]
            mask = torch.zeros(capacity, dtype=torch.bool, device=self.device)
            mask[: written[key].shape[0]] = written[key]
            tensors[key], written[key] = grown, mask
        return tensors[key], written[key]


class _ContiguousStep:
    def __init__(self, cache: ContiguousV4Cache, seq_ids: list[int], layout: StepLayout) -> None:
        self.cache, self.seq_ids, self.layout = cache, seq_ids, layout

    def _decl(self, layer: int, kind: CacheKind) -> CacheDecl:
        decl = self.cache.decls.get((layer, kind))
        if decl is None:
            raise KeyError(f"layer {layer} declares no {kind.value} cache")
        return decl

    def read(self, seq: int, layer: int, kind: CacheKind, index: torch.Tensor) -> torch.Tensor:
        decl = self._decl(layer, kind)
        if index.numel() == 0:
            return torch.empty((0, decl.width), dtype=self.cache.dtype, device=self.cache.device)
        start, end = self.layout.starts[seq], self.layout.starts[seq] + self.layout.query_lens[seq]
        low, high = int(index.min()), int(index.max())
        limit = end // decl.tokens_per_row
        if high >= limit or (decl.lookback is not None and low < start - decl.lookback):
            raise RuntimeError(
                f"layer {layer} {kind.value}: a step at positions {start}..{end - 1} read rows {low}..{high}, "
                f"outside what the declaration allows (lookback {decl.lookback}, rows < {limit})"
            )
        tensor, written = self.cache._store(self.seq_ids[seq], (layer, kind), high + 1)
        if not bool(written[index].all()):
            raise RuntimeError(
                f"layer {layer} {kind.value}: read of rows not held (never written, released or rolled back) "
                f"among {index.tolist()}"
            )
        return tensor[index]

    def write(self, seq: int, layer: int, kind: CacheKind, index: torch.Tensor, rows: torch.Tensor) -> None:
        decl = self._decl(layer, kind)
        if index.numel() == 0:
            return
        if rows.shape != (index.numel(), decl.width):
            raise ValueError(
                f"layer {layer} {kind.value}: rows {tuple(rows.shape)} for {index.numel()} indices of width {decl.width}"
            )
        tensor, written = self.cache._store(self.seq_ids[seq], (layer, kind), int(index.max()) + 1)
        tensor[index] = rows.to(self.cache.dtype)
        written[index] = True
