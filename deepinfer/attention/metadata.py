"""Per-step attention metadata, built once by the runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Sequences are ordered decodes first (query length 1), then prefill chunks.

    Tokens of the step are flattened in that order; sequence i owns tokens
    query_start[i] : query_start[i + 1] at context positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    seq_lens: torch.Tensor  # [B] int64: context length after this step
    query_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int  # the first num_decodes sequences have query length 1
    block_size: int
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific precomputation

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
