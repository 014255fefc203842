"""Tensors and attention metadata for a drafting forward: rows of several sequences at once.

A draft model or an MTP module runs over the same paged layout as the target model (same block
tables, same slots) but on rows of its own choosing: a catch-up chunk, then one row per sequence
per drafting round. This builds what the runner's `_prepare` builds for a step, from plain spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class RowSpan:
    """Consecutive rows of one sequence: positions start .. start + len(token_ids) - 1."""

    block_table: list[int]
    start: int
    token_ids: list[int]


@dataclass(slots=True)
class DraftStep:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    offsets: list[int]  # first flattened row of each span, in the order the spans were given

    def last_rows(self, spans: list[RowSpan]) -> torch.Tensor:
        """Flattened index of each span's last row, in span order."""
        rows = [offset + len(span.token_ids) - 1 for offset, span in zip(self.offsets, spans)]
        return torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)


def build_draft_step(spans: list[RowSpan], block_size: int, device: torch.device) -> DraftStep:
    """Lay spans out like a scheduler step: single rows (decodes) first, then longer chunks."""
    order = sorted(range(len(spans)), key=lambda i: len(spans[i].token_ids) != 1)
    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    offsets = [0] * len(spans)
    max_blocks = max(len(span.block_table) for span in spans)
    tables = np.zeros((len(spans), max_blocks), dtype=np.int64)
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for row, i in enumerate(order):
        span = spans[i]
        offsets[i] = len(token_ids)
        count = len(span.token_ids)
        token_ids.extend(span.token_ids)
        pos = np.arange(span.start, span.start + count, dtype=np.int64)
        table = np.asarray(span.block_table, dtype=np.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables[row, : len(span.block_table)] = table
        query_lens.append(count)
        seq_lens.append(span.start + count)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        num_decodes=sum(1 for q in query_lens if q == 1),
        block_size=block_size,
    )
    return DraftStep(
        torch.tensor(token_ids, dtype=torch.long, device=device),
        torch.from_numpy(np.concatenate(positions)).to(device),
        meta,
        offsets,
    )
