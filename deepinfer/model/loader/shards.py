"""Where this rank's part of a whole checkpoint tensor goes in a sharded model's parameters.

A module declares how its parameters are split over the tensor-parallel group in `splits`
(parameter name -> (dimension, the segments stacked along it)): the parallel layers of
layers/parallel_linear.py do, and so do the family modules that hold plain parameters.
Expert-parallel experts (ExpertParallelExperts) hold some replicas of some experts; a packed GGUF
linear (never split) declares its bias whole, one segment per packed matrix. In one process every
segment is whole and every expert local, so the map sends each tensor to its whole region.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.model.layers.expert_parallel import ExpertParallelExperts
from deepinfer.model.layers.parallel_linear import Segment


class ShardMap:
    def __init__(self, model: torch.nn.Module) -> None:
        self.splits: dict[str, tuple[int, list[Segment]]] = {}
        self.expert_slots: dict[str, ExpertParallelExperts] = {}
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for param_name, split in getattr(module, "splits", {}).items():
                self.splits[prefix + param_name] = split
            if isinstance(module, ExpertParallelExperts):
                self.expert_slots[prefix + "w13"] = self.expert_slots[prefix + "w2"] = module

    def named_parts(
        self, name: str, param_name: str, index: Any, tensor: torch.Tensor
    ) -> list[tuple[Any, torch.Tensor]]:
        """`parts`, with a split of the wrong size reported under the checkpoint tensor's name."""
        try:
            return self.parts(param_name, index, tensor)
        except ValueError as exc:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit {param_name} ({exc}; "
                "check config.json against the checkpoint)"
            ) from None

    def parts(self, param_name: str, index: Any, tensor: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
        """(index into this rank's parameter, the part of `tensor` that goes there) for a
        checkpoint tensor whose place in the whole parameter is `index`: None (all of it), a row
        slice (a fused segment), an expert, or (expert, row slice). An expert-parallel expert goes
        to each local slot holding a replica of it (none if this rank holds none); a split
        parameter gets this rank's part of the tensor's segment. Raises ValueError when the tensor
        does not have the segment's size."""
        expert, rows = (
            (index, None) if isinstance(index, int) else index if isinstance(index, tuple) else (None, index)
        )
        if param_name in self.expert_slots:
            slots = self.expert_slots[param_name].local_slots(expert)
            return [((slot, rows) if rows is not None else slot, tensor) for slot in slots]
        split = self.splits.get(param_name)
        if split is None:
            return [(index, tensor)]
        dim, segments = split
        starts = [sum(s.size for s in segments[:k]) for k in range(len(segments))]
        k = 0 if rows is None else starts.index(rows.start)
        offset = sum(s.local for s in segments[:k])
        local = (slice(None),) * dim + (slice(offset, offset + segments[k].local),)
        return [(((expert,) if expert is not None else ()) + local, segments[k].take(tensor, dim))]
