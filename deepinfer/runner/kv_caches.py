"""The KV-cache tensors of every cache group, for every model of the engine (the target, a draft
model, MTP), allocated once from the planned layout.

Group g's tensors are [num_slots_g, *slot_shape]; the models sharing a group address it with the
same block tables. Block copies (copy-on-write) and transfers to other tiers go through here.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.cache_layout import CacheGroup, CacheLayout, GroupLayout
from deepinfer.runner.inputs import ForwardInputs, RowSpan, build_inputs
from deepinfer.runner.staging import Upload, upload_for
from deepinfer.sequence import Sequence


@dataclass(slots=True)
class CacheView:
    """One model's side of the caches: its tensors and the engine groups its own groups are."""

    tensors: list[torch.Tensor]
    group_indices: list[int]  # engine (KV manager) group of each of the model's groups
    groups: list[GroupLayout]
    device: torch.device
    upload: Upload | None = None  # how each step's host arrays reach the device (staging.py)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block tables of this model's groups, in the model's order."""
        return [seq.block_tables[g] for g in self.group_indices]

    def inputs(self, spans: list[RowSpan]) -> ForwardInputs:
        """Inputs (tensors and metadata) for a forward of this model over `spans`."""
        return build_inputs(spans, self.groups, self.device, self.upload)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cache tensor of zeros (not empty: masked attention weights multiply unused slots, and
    NaN * 0 is NaN). On the CPU its memory is an anonymous mapping, which the OS fills with zeros
    page by page on first touch: torch.zeros wrote every page of a 2 GB default cache at each
    engine start (2.3 s of a 3.1 s start), where now each block's pages are faulted in when first
    written. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _blocks(tensor: torch.Tensor, per_block: int) -> np.ndarray:
    """A CPU cache tensor's memory as [blocks, block bytes] uint8 (a view: writes land in the
    cache); its slot count is a whole number of blocks (a scratch block included)."""
    assert tensor.is_contiguous()
    return tensor.view(torch.uint8).numpy().reshape(tensor.shape[0] // per_block, -1)


class KVCaches:
    def __init__(
        self,
        layout: CacheLayout,
        declared: dict[str, list[CacheGroup]],
        device: torch.device,
        scratch_block: bool = False,
    ) -> None:
        """`declared`: each owner's cache groups in its own order (their tensors are in `layout`,
        merged into compatible groups). `scratch_block`: each group gets one block past the
        layout's, block id `num_blocks`, which the KV manager never hands out: the padding rows
        of a CUDA-graph decode step write there (runner/graphs.py)."""
        self.layout = layout
        self.device = device
        self.scratch_block = scratch_block
        extra = [g.entries_per_block if scratch_block else 0 for g in layout.groups]
        self.tensors: list[list[torch.Tensor]] = [
            [
                zeroed((g.num_slots + pad, *t.slot_shape), getattr(torch, t.dtype), device)
                for t in g.group.tensors
            ]
            for g, pad in zip(layout.groups, extra)
        ]
        self.owner_groups: dict[str, list[int]] = {}
        self._owned: dict[str, list[torch.Tensor]] = {}
        # One stager per model: its buffer is refilled only after its last copy was read.
        self._uploads: dict[str, Upload] = {}
        for owner, groups in declared.items():
            indices = [self._index_of(group) for group in groups]
            self.owner_groups[owner] = indices
            self._owned[owner] = [
                tensor
                for g in indices
                for spec, tensor in zip(layout.groups[g].group.tensors, self.tensors[g])
                if spec.owner == owner
            ]

    def _index_of(self, group: CacheGroup) -> int:
        for i, g in enumerate(self.layout.groups):
            if g.group.compatible(group):
                return i
        raise ValueError(f"cache group {group.layout()} is not in the planned layout")

    def view(self, owner: str) -> CacheView:
        """What a model's forward needs of the caches: its tensors (in the order of its declared
        groups' tensors) and its groups."""
        indices = self.owner_groups[owner]
        upload = self._uploads.get(owner)
        if upload is None:
            upload = self._uploads[owner] = upload_for(self.device)
        groups = [self.layout.groups[g] for g in indices]
        return CacheView(self._owned[owner], indices, groups, self.device, upload)

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Apply (group, src block, dst block) copies to every tensor of the group."""
        by_group: dict[int, list[tuple[int, int]]] = {}
        for group, src, dst in copies:
            by_group.setdefault(group, []).append((src, dst))
        for group, pairs in by_group.items():
            per_block = self.layout.groups[group].entries_per_block
            src = self._slots([s for s, _ in pairs], per_block)
            dst = self._slots([d for _, d in pairs], per_block)
            for tensor in self.tensors[group]:
                tensor[dst] = tensor[src]

    def _slots(self, block_ids: list[int], per_block: int) -> torch.Tensor:
        offsets = torch.arange(per_block)
        slots = torch.tensor(block_ids, dtype=torch.long)[:, None] * per_block + offsets
        return slots.flatten().to(self.device)

    def read_blocks(self, group: int, block_ids: list[int]) -> np.ndarray:
        """One group's whole blocks as host bytes [blocks, block_bytes] (uint8): row i is block
        `block_ids[i]`, its slots of each of the group's tensors in order. Raw bytes, so tensors
        of different widths and dtypes (bfloat16 included) travel the same way."""
        per_block = self.layout.groups[group].entries_per_block
        if self.device.type == "cpu":
            ids = np.asarray(block_ids, dtype=np.int64)
            return np.concatenate([_blocks(t, per_block)[ids] for t in self.tensors[group]], axis=1)
        slots = self._slots(block_ids, per_block)
        rows = [t[slots].view(torch.uint8).reshape(len(block_ids), -1) for t in self.tensors[group]]
        return torch.cat(rows, dim=1).cpu().numpy()

    def write_blocks(self, group: int, block_ids: list[int], kv: np.ndarray) -> None:
        """Inverse of read_blocks: fill whole blocks from host bytes [blocks, block_bytes]."""
        layout = self.layout.groups[group]
        if kv.dtype != np.uint8 or kv.shape != (len(block_ids), layout.block_bytes):
            raise ValueError(
                f"KV of {kv.dtype} {tuple(kv.shape)} does not fit {len(block_ids)} blocks of "
                f"{layout.block_bytes} bytes"
            )
        if self.device.type == "cpu":
            # Straight from the payload into each tensor's blocks, one copy: through an index
            # tensor it took three copies and torch's element-wise index_put (the 73 MiB of a
            # 3,328-token prefix on cache pages already touched: 19.8 ms then, 8.4 ms now).
            ids = np.asarray(block_ids, dtype=np.int64)
            start = 0
            for tensor in self.tensors[group]:
                blocks = _blocks(tensor, layout.entries_per_block)
                blocks[ids] = kv[:, start : start + blocks.shape[1]]
                start += blocks.shape[1]
            return
        slots = self._slots(block_ids, layout.entries_per_block)
        data = torch.from_numpy(np.array(kv)).to(self.device)  # a writable copy: store buffers are read-only
        start = 0
        for tensor in self.tensors[group]:
            width = layout.entries_per_block * tensor[0].numel() * tensor.element_size()
            part = data[:, start : start + width].contiguous().view(tensor.dtype)
            tensor[slots] = part.reshape(len(slots), *tensor.shape[1:])
            start += width
