"""One weight loader for every family: checkpoint tensors into (this rank's part of) parameters.

The loader takes the model and a stream of (checkpoint name, tensor) from any source (safetensors
shards, a GGUF dequantized, FP8 or MXFP4 checkpoints through loader/scaled.py) and writes each
tensor where it goes. The knowledge is split the way nano-vllm splits it:
- each module declares how its parameters are laid out over the tensor-parallel group (`splits`:
  a fused linear its segments, a split layer its shard dimension) or the expert-parallel group
  (ExpertParallelExperts); loader/shards.py reads those declarations;
- each family supplies only its `NameMap`: where a checkpoint name goes (a `Target`: parameter,
  place in the whole parameter, optional transform), which spellings are the same tensor, which
  parameters stay float32.
The loader does the rest for all of them: duplicate names, shape checks, fill counting, and the
final check that every parameter was filled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.model.loader.shards import ShardMap

log = logging.getLogger(__name__)

_SHOWN = 8


@dataclass(slots=True, frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param` (a parameter or buffer name of the model) and the
    tensor's place in the whole parameter (`index`: None for all of it, a row slice for a fused
    segment, an expert number, or (expert, row slice)), after an optional `transform`."""

    param: str
    index: Any = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


class NameMap:
    """A family's checkpoint names. Subclasses override `route` and, where they differ from these
    defaults, the rest."""

    # Raised when the checkpoint leaves a parameter unfilled (KeyError or ValueError: each family
    # keeps the exception its callers catch).
    missing_error: type[Exception] = ValueError
    # Whether the model's buffers are checkpoint tensors too (else only its parameters are).
    loads_buffers: bool = False

    def key(self, name: str) -> str:
        """The spelling duplicates are detected on (two spellings of one tensor are one)."""
        return name

    def route(self, loader: WeightLoader, name: str, key: str) -> Target | None:
        """Where checkpoint tensor `name` (spelled `key`) goes; None: it is not loaded. Raises,
        naming the tensor, for a name the model has no place for."""
        raise NotImplementedError

    def keeps_float32(self, param: str) -> bool:
        """Whether `param` is stored float32 whatever the model's dtype (routers, mixing weights)."""
        return False


class WeightLoader:
    """Routes each tensor through a family's NameMap and counts the elements each parameter gets."""

    def __init__(self, model: torch.nn.Module, names: NameMap) -> None:
        self.model = model
        self.names = names
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        if names.loads_buffers:
            self.params.update(model.named_buffers())
        self.filled = dict.fromkeys(self.params, 0)  # elements written per parameter
        self.shards = ShardMap(model)
        self.seen: set[str] = set()

    def load_all(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`load` every tensor of `weights`."""
        for name, tensor in weights:
            self.load(name, tensor)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Write this rank's part of `tensor` into its parameter (replacing the parameter's data
        when it stays float32); records the name and the elements written."""
        key = self.names.key(name)
        if key in self.seen:
            raise ValueError(f"weight {name!r} appears twice in the checkpoint")
        self.seen.add(key)
        target = self.names.route(self, name, key)
        if target is None:
            return
        if target.transform is not None:
            tensor = target.transform(tensor)
        param = self.params[target.param]
        for index, part in self.shards.named_parts(name, target.param, target.index, tensor):
            region = param.data[index] if index is not None else param.data
            if tuple(region.shape) != tuple(part.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit {target.param} "
                    f"(expected {tuple(region.shape)}; check config.json against the checkpoint)"
                )
            if self.names.keeps_float32(target.param):
                param.data = part.to(param.device, torch.float32)
            else:
                region.copy_(part)
            self.filled[target.param] += part.numel()

    def candidate(self, candidates: Iterable[str], unexpected: Exception) -> Target:
        """The first of `candidates` that is a parameter, whole; raises `unexpected` when none is."""
        for param in candidates:
            if param in self.params:
                return Target(param)
        raise unexpected

    def segment_rows(self, param: str, segment: int) -> slice:
        """The rows of fused segment `segment` in the whole (unsplit) parameter `param`, as its
        module declares them."""
        _, segments = self.shards.splits[param]
        start = sum(s.size for s in segments[:segment])
        return slice(start, start + segments[segment].size)

    def loaded_any(self, prefix: str) -> bool:
        """Whether any parameter under `prefix` got an element."""
        return any(self.filled[n] for n in self.params if n.startswith(prefix))

    def drop_if_unloaded(self, attribute: str, message: str) -> None:
        """Replace the model's optional module list `attribute` by an empty one (logging
        `message`) when it has parameters and the checkpoint filled none of them."""
        prefix = f"{attribute}."
        if any(n.startswith(prefix) for n in self.params) and not self.loaded_any(prefix):
            log.info(message)
            setattr(self.model, attribute, torch.nn.ModuleList())

    def finish(self) -> None:
        """Raise the family's missing_error naming every parameter of the model (as it is now:
        optional parts dropped) that the checkpoint did not fill whole."""
        live = dict(self.model.named_parameters())
        if self.names.loads_buffers:
            live.update(self.model.named_buffers())
        incomplete = [
            f"{n} ({100 * self.filled.get(n, 0) // max(t.numel(), 1)}% loaded)"
            for n, t in live.items()
            if self.filled.get(n, 0) != t.numel()
        ]
        if incomplete:
            more = "..." if len(incomplete) > _SHOWN else ""
            raise self.names.missing_error(
                f"weights missing from the checkpoint for: {incomplete[:_SHOWN]}{more}"
            )
