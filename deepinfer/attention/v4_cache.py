"""What DeepSeek-V4's attention keeps between steps, and a plain contiguous store for it.

Every kept tensor is a list of rows at a logical index, so each maps onto a paged cache group
(logical index -> block table -> slot) the way the usual KV cache does:

kind              rows per token  row width (values)          layers    a step reads back
sliding_kv        1               head_dim (K = V)            all       the W - 1 positions before
                                                                        its first token (W = window)
compressor_state  1               CSA: 4 * head_dim           CSA, HCA  CSA: up to 2m - 1 positions
                                  HCA: 2 * head_dim                     before, HCA: up to m - 1
compressed_kv     1 / m           head_dim                    CSA, HCA  HCA: every entry; CSA: only
                                                                        the entries the indexer picks
indexer_state     1               4 * index_head_dim          CSA       up to 2m - 1 positions before
indexer_keys      1 / m           index_head_dim              CSA       every entry

(m: the layer's compress rate.) A compressor-state row is the token's raw compressor projections
[kv | gate] (CSA and the indexer: two halves each, for the overlapping windows); entry w of a
compressed kind pools the rows of tokens w*m .. w*m + m - 1 (CSA also the previous window's) and
is written by the step holding its last token, (w + 1) * m - 1. A step writes every row of its
own tokens and entries before reading, and never reads past its last token, so rolling a
sequence back (rejected draft tokens) needs no undo: the indices are written again.

DeepSeek-V4.1 (attention/v41_paged.py) keeps the same kinds in its own widths (its C2 compressor
state one [logits | latent] row per token, read back 1 position; its C1 entries one per token)
and one more: `token_ids` (int64), the context its Engram n-grams read before a step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch


class CacheKind(enum.StrEnum):
    SLIDING_KV = "sliding_kv"
    COMPRESSOR_STATE = "compressor_state"
    COMPRESSED_KV = "compressed_kv"
    INDEXER_STATE = "indexer_state"
    INDEXER_KEYS = "indexer_keys"
    TOKEN_IDS = "token_ids"


# Kinds whose rows are integers (int64 in every cache dtype): the others are model values.
INTEGER_KINDS = frozenset({CacheKind.TOKEN_IDS})


@dataclass(slots=True, frozen=True)
class CacheDecl:
    """One tensor one layer keeps per sequence."""

    layer: int
    kind: CacheKind
    width: int  # values per row
    tokens_per_row: int  # 1: one row per token; m: one entry per m tokens
    lookback: int | None  # positions before a step's first token it may read; None: every row

    def bytes_per_token(self, element_size: int) -> float:
        """Bytes of one row per token it covers (a compressed entry covers tokens_per_row tokens)."""
        return self.width * element_size / self.tokens_per_row

    def rows_held(self, num_tokens: int) -> int:
        """Rows a sequence of num_tokens must hold to continue (windowed kinds: the worst case)."""
        if self.lookback is None:
            return num_tokens // self.tokens_per_row
        return min(num_tokens, self.lookback)

    def bytes_held(self, num_tokens: int, element_size: int) -> int:
        return self.rows_held(num_tokens) * self.width * element_size


@dataclass(slots=True, frozen=True)
class StepLayout:
    """A step's sequences in the order their tokens are flattened: sequence i owns the flat tokens
    offsets[i] : offsets[i + 1], at positions starts[i] .. starts[i] + query_lens[i] - 1."""

    starts: tuple[int, ...]
    query_lens: tuple[int, ...]

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out

    @classmethod
    def from_lengths(cls, query_lens: list[int], context_lens: list[int]) -> StepLayout:
        """From the engine's per-step lengths (context_len: the sequence's length after the step)."""
        return cls(tuple(c - q for q, c in zip(query_lens, context_lens)), tuple(query_lens))


class V4Cache(Protocol):
    """The attention's only access to kept state. `seq` is the sequence's index in the step."""

    def read(self, seq: int, layer: int, kind: CacheKind, index: torch.Tensor) -> torch.Tensor:
        """Rows [len(index), width] at logical `index` (token positions, or entry numbers for the
        compressed kinds). Mutates nothing."""
        ...

    def write(self, seq: int, layer: int, kind: CacheKind, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores rows [len(index), width] at logical `index`, replacing what was there."""
        ...


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


def kv_cache_bytes(decls: list[CacheDecl], num_tokens: int, element_size: int) -> dict[CacheKind, int]:
    """Bytes one sequence of num_tokens holds, per kind, summed over layers."""
    out: dict[CacheKind, int] = {}
    for decl in decls:
        out[decl.kind] = out.get(decl.kind, 0) + decl.bytes_held(num_tokens, element_size)
    return out
