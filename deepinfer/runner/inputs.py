"""A forward's input tensors and attention metadata, from plain spans of rows.

The runner lays out a scheduled step this way, and a draft model or MTP module its drafting
rounds (the same paged layout, rows of their own choosing). Rows are ordered single-row spans
(decodes) first, then longer chunks, so attention backends batch the decodes in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.attention.metadata import AttentionMetadata, ForwardMetadata
from deepinfer.cache_layout import GroupLayout
from deepinfer.image_input import ImageInput
from deepinfer.runner.staging import Upload, direct_upload


@dataclass(slots=True)
class RowSpan:
    """Consecutive rows of one sequence: positions start .. start + len(token_ids) - 1, reading
    the caches through `block_tables` (one per cache group of the model, in its order);
    `images`: the sequence's images with a token among these positions."""

    block_tables: list[list[int]]
    start: int
    token_ids: list[int]
    prompt_len: int = 0  # the sequence's prompt length (0: not a scheduled sequence's rows)
    images: list[ImageInput] = field(default_factory=list)


@dataclass(slots=True)
class ForwardWork:
    """One forward, as plain data: what every rank of a tensor-parallel group runs identically
    (rank 0 sends it to the others before running it itself). `logit_rows`: the distinct
    flattened rows, ascending, whose logits are computed."""

    spans: list[RowSpan]
    block_copies: list[tuple[int, int, int]]
    logit_rows: list[int]


def span_offsets(spans: list[RowSpan]) -> tuple[list[int], list[int]]:
    """(first flattened row of each span in the given order, the order rows are laid out in):
    single-row spans (decodes) first, then longer chunks, each group in the given order."""
    order = sorted(range(len(spans)), key=lambda i: len(spans[i].token_ids) != 1)
    offsets = [0] * len(spans)
    row = 0
    for i in order:
        offsets[i] = row
        row += len(spans[i].token_ids)
    return offsets, order


@dataclass(slots=True)
class ForwardInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: ForwardMetadata
    offsets: list[int]  # first flattened row of each span, in the order the spans were given

    def last_rows(self, spans: list[RowSpan]) -> torch.Tensor:
        """Flattened index of each span's last row, in span order."""
        rows = [offset + len(span.token_ids) - 1 for offset, span in zip(self.offsets, spans)]
        return torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)


def _group_arrays(
    spans: list[RowSpan], group: int, layout: GroupLayout, positions: np.ndarray, query_lens: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(slot mapping [T], block tables [B, W]) of one cache group, on the host."""
    per_block, rate = layout.entries_per_block, layout.group.tokens_per_entry
    tables_list = [np.maximum(np.asarray(s.block_tables[group], dtype=np.int64), 0) for s in spans]
    width = max((len(t) for t in tables_list), default=0)
    tables = np.zeros((len(spans), width), dtype=np.int64)
    slots = [np.zeros(0, dtype=np.int64)]
    first = 0
    for row, (table, count) in enumerate(zip(tables_list, query_lens)):
        tables[row, : len(table)] = table
        pos = positions[first : first + count]
        first += count
        entry = pos // rate  # the entry (the token itself, or its compressed entry) a position writes
        slots.append(table[entry // per_block] * per_block + entry % per_block)
    return np.concatenate(slots), tables


def build_inputs(
    spans: list[RowSpan], groups: list[GroupLayout], device: torch.device, upload: Upload | None = None
) -> ForwardInputs:
    """Tensors for a forward over `spans`, with one AttentionMetadata per group in `groups`
    (no spans: the empty forward of a rank without work that steps with the others). `upload`:
    how the host arrays reach the device (staging.py; default: one copy each)."""
    offsets, order = span_offsets(spans)
    ordered = [spans[i] for i in order]
    token_ids = [t for span in ordered for t in span.token_ids]
    query_lens = [len(s.token_ids) for s in ordered]
    seq_lens = [s.start + len(s.token_ids) for s in ordered]
    positions = np.concatenate(
        [np.zeros(0, dtype=np.int64)]
        + [np.arange(s.start, s.start + len(s.token_ids), dtype=np.int64) for s in ordered]
    )
    arrays = [np.asarray(token_ids, dtype=np.int64), positions]
    for g, layout in enumerate(groups):
        # each group its own lengths tensor, as a backend may keep per-group views of it
        arrays += [*_group_arrays(ordered, g, layout, positions, query_lens), np.asarray(seq_lens, np.int64)]
    tensors = (upload or direct_upload(device))(arrays)
    meta = ForwardMetadata(
        [
            AttentionMetadata(
                slot_mapping=tensors[2 + 3 * g],
                block_tables=tensors[3 + 3 * g],
                seq_lens=tensors[4 + 3 * g],
                query_lens=query_lens,
                seq_lens_list=seq_lens,
                num_decodes=sum(1 for q in query_lens if q == 1),
                block_size=layout.entries_per_block,
                window=layout.group.window,
            )
            for g, layout in enumerate(groups)
        ],
        [s.prompt_len for s in ordered],
    )
    return ForwardInputs(tensors[0], tensors[1], meta, offsets)
