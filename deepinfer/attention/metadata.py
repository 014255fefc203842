"""Per-step attention metadata, built once by the runner and read by every layer.

A model with several cache groups (full attention, sliding windows, ...) gets one
AttentionMetadata per group, in a ForwardMetadata; each layer reads its own group's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One cache group's view of a step. Sequences are ordered decodes first (query length 1),
    then prefill chunks.

    Tokens of the step are flattened in that order; sequence i owns tokens
    query_start[i] : query_start[i + 1] at context positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded, and released blocks, as 0)
    seq_lens: torch.Tensor  # [B] int64: context length after this step
    query_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int  # the first num_decodes sequences have query length 1
    block_size: int  # slots per block
    window: int | None = None  # sliding window: a query sees its last `window` positions
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific precomputation

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    def first_key_position(self, i: int) -> int:
        """The earliest position any query of sequence i attends to."""
        if self.window is None:
            return 0
        first_query = self.seq_lens_list[i] - self.query_lens[i]
        return max(first_query - self.window + 1, 0)


@dataclass(slots=True)
class ForwardMetadata:
    """A step's metadata for every cache group of the model (in the model's group order)."""

    groups: list[AttentionMetadata]
    # Per sequence in layout order, its prompt's length (0: none given, as for draft rows or
    # scoring); YoCo's bounded replay clips a prompt's rows relative to its end.
    prompt_lens: list[int] = field(default_factory=list)

    @property
    def query_lens(self) -> list[int]:
        return self.groups[0].query_lens

    @property
    def num_decodes(self) -> int:
        return self.groups[0].num_decodes
