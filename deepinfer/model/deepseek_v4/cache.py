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

DeepSeek-V4.1 (model/deepseek_v4/v41_paged.py) keeps the same kinds in its own widths (its C2 compressor
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


def kv_cache_bytes(decls: list[CacheDecl], num_tokens: int, element_size: int) -> dict[CacheKind, int]:
    """Bytes one sequence of num_tokens holds, per kind, summed over layers."""
    out: dict[CacheKind, int] = {}
    for decl in decls:
        out[decl.kind] = out.get(decl.kind, 0) + decl.bytes_held(num_tokens, element_size)
    return out
