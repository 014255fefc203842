"""YoCo's bounded replay (DeepSeek's `compact` prefill truncation), as a step's plan.

A YoCo model's layers from the boundary on (the consumer layers) take every compressed KV from
the boundary's attention input, the shared hidden, which the layers before compute for every
token. So a prompt's consumer rows are only needed where they are read: by the prompt's last
KEEP tokens, their own sliding windows and what decodes after them. Bounded replay runs the
consumer layers on those KEEP tokens only ("the rect", positions from `floor = prompt_len -
KEEP` on) and clips every consumer sliding window to it, so nothing reads a consumer row before
the floor:

- rows skipped: a chunk's rows before the floor are not computed from the boundary on, and
  their consumer sliding KV is never written. A chunk wholly before the floor still runs its
  last row (its window empty) so every sequence has a last row, as DeepSeek keeps one;
- kept rows see keys at max(p - W + 1, floor) .. p in the consumer layers (the compressed
  entries are not clipped: they come from the shared hidden of every token);
- the kept rows equal computing every row with the same clipped windows (DeepSeek's `mask`
  mode), not the unclipped model: a consumer row at p differs from it where its windows, through
  the consumer layers, reach back before the floor, i.e. unless p >= floor + n_consumer * (W - 1);
- a decode after the prompt reads consumer rows from p - W + 1 on; keeping KEEP >= W + B tokens
  (B: the most tokens a sequence rolls back) keeps every such row inside the rect, even after a
  rollback. `check_keep_tokens` refuses less.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import ConfigError, EngineConfig
from deepinfer.model.deepseek_v4.cache import StepLayout

KEEP_OPTION = "yoco_prefill_keep_tokens"


def engine_backtrack(engine: EngineConfig) -> int:
    """The most tokens the engine rolls a sequence back: the drafts a step verifies."""
    return engine.speculative.num_speculative_tokens if engine.speculative.enabled else 0


def min_keep_tokens(window: int, backtrack: int) -> int:
    """The fewest prompt tokens bounded replay may keep: a window after rolling back `backtrack`."""
    return window + backtrack


def check_keep_tokens(keep: int, window: int, backtrack: int) -> None:
    least = min_keep_tokens(window, backtrack)
    if keep < least:
        raise ConfigError(
            KEEP_OPTION,
            f"{keep} is below the minimum {least}: the sliding window ({window}) plus the tokens a "
            f"sequence may roll back ({backtrack}), so decoding never reads a skipped row",
        )


def prompt_floors(layout: StepLayout, prompt_lens: tuple[int, ...], keep: int) -> tuple[int, ...]:
    """Each sequence's floor for a step: prompt_len - keep while the step is inside the prompt,
    0 (nothing clipped) once it decodes past it."""
    return tuple(
        max(0, n - keep) if start < n else 0 for start, n in zip(layout.starts, prompt_lens, strict=True)
    )


@dataclass(frozen=True)
class BoundedReplay:
    """The rows the consumer layers run in one step (per sequence in the step's layout)."""

    full_layout: StepLayout  # the step's rows (the shared hidden's, the compressors')
    layout: StepLayout  # the kept rows: from max(start, floor), at least the chunk's last row
    rows: torch.Tensor  # [kept] long: the kept rows' indices among the step's flat tokens
    positions: torch.Tensor  # [kept]
    floors: tuple[int, ...]  # no consumer window reaches before its sequence's floor

    @classmethod
    def plan(cls, layout: StepLayout, floors: tuple[int, ...], device: torch.device) -> BoundedReplay:
        if len(floors) != len(layout.starts):
            raise ValueError(f"{len(floors)} floors for a step layout of {len(layout.starts)} sequences")
        firsts = tuple(
            min(max(start, floor), start + n - 1)
            for start, n, floor in zip(layout.starts, layout.query_lens, floors)
        )
        kept_lens = tuple(
            start + n - first for start, n, first in zip(layout.starts, layout.query_lens, firsts)
        )
        offsets = layout.offsets
        rows = [
            torch.arange(offsets[seq] + first - start, offsets[seq + 1])
            for seq, (start, first) in enumerate(zip(layout.starts, firsts, strict=True))
        ]
        positions = [torch.arange(first, first + n) for first, n in zip(firsts, kept_lens, strict=True)]
        return cls(
            layout,
            StepLayout(firsts, kept_lens),
            torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device),
            torch.cat(positions).to(device) if positions else torch.zeros(0, dtype=torch.long, device=device),
            floors,
        )

    def keep(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-row tensor of the step [T, ...] -> its kept rows [kept, ...]."""
        return None if t is None else t[self.rows]

    def spread(self, kept: torch.Tensor) -> torch.Tensor:
        """Kept rows [kept, ...] -> the step's rows [T, ...], NaN where a row was not computed."""
        full = kept.new_full((self.full_layout.offsets[-1], *kept.shape[1:]), float("nan"))
        full[self.rows] = kept
        return full
