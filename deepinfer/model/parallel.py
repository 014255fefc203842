"""What a model needs to know to build its shard: the tensor-parallel group it splits its layers
over and, for MoE models, how experts are placed over the expert-parallel ranks.

`None` everywhere means one process holding the whole model, and every layer then runs exactly
the code (and numerics) of the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.distributed.comm import Collectives


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` of `total` items in `parts` contiguous parts; the first
    `total % parts` parts get one item more."""
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in the group every layer is split over, and the group's collectives
    (`comm` is None for a group of one)."""

    rank: int
    size: int
    comm: Collectives | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial `x`, in place."""
        if self.comm is None or self.size == 1:
            return x
        return self.comm.all_reduce(x)

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's x [..., sizes[r]] along the last dimension (parts padded to the
        largest on the wire, since the collective moves equal shapes)."""
        if self.comm is None or self.size == 1:
            return x
        width = max(sizes)
        padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = self.comm.all_gather(padded.contiguous())
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)

    def gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate every rank's rows x [counts[r], ...] in rank order."""
        if self.comm is None or self.size == 1:
            return x
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = self.comm.all_gather(padded)
        return torch.cat([part[:count] for part, count in zip(parts, counts)])


SINGLE = TensorParallel(0, 1)


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """Whole experts sharded over `size` ranks (every rank of the engine): rank r holds physical
    experts r * slots .. (r + 1) * slots - 1, each a replica of one logical expert. Tokens of the
    ranks of one tensor-parallel group are the same: each dispatches its `tp` share of them."""

    rank: int
    size: int
    comm: Collectives
    tp: TensorParallel
    num_redundant_experts: int = 0
    record_load: bool = False  # EPLB: count the tokens routed to every logical expert


@dataclass(frozen=True, slots=True)
class ModelParallel:
    tp: TensorParallel = SINGLE
    ep: ExpertParallel | None = None

    @property
    def is_single(self) -> bool:
        return self.tp.size == 1 and self.ep is None
