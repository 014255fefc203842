"""Cache groups: what a model keeps per token (or per compressed entry) between steps, and how one
memory budget is split between the groups. Plain data and arithmetic, no torch.

A model declares its groups; each group is the set of layers (and of the draft model's or MTP's
layers, when they share its block tables) whose caches follow one block table per sequence:

- `full`: one entry per token, every past token attended (Llama, MLA's latent cache).
- `sliding`: one entry per token, a query sees the last `window` positions only, so blocks that
  fall out of the window are released while the sequence runs.
- `compressed`: one entry per `tokens_per_entry` tokens (DeepSeek-V4's compressed KV); a block
  holds `entries_per_block` entries, i.e. covers `entries_per_block * tokens_per_entry` tokens.

Every tensor of a group is `[num_blocks * entries_per_block, *slot_shape]` (the slot axis first, as
everywhere in the engine); tensor `i` of the group belongs to the model named by its `owner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Literal

from deepinfer.utils import cdiv

CacheKind = Literal["full", "sliding", "compressed"]
KINDS: tuple[str, ...] = ("full", "sliding", "compressed")


@dataclass(frozen=True, slots=True)
class CacheTensor:
    """One layer's cache: a slot of `slot_shape` elements of `dtype` (a torch dtype's name)."""

    name: str
    slot_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    owner: str = "target"  # "target", "draft" or "mtp": whose forward reads and writes it

    @property
    def slot_bytes(self) -> int:
        return prod(self.slot_shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class CacheGroup:
    kind: CacheKind
    tensors: tuple[CacheTensor, ...]
    window: int | None = None  # sliding: positions a query sees, itself included
    tokens_per_entry: int = 1  # compressed: tokens folded into one entry

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"cache group kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError("a sliding cache group has a window, and only a sliding one")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")
        if (self.kind == "compressed") != (self.tokens_per_entry > 1):
            raise ValueError("a compressed cache group folds more than one token into an entry")
        if not self.tensors:
            raise ValueError("a cache group holds at least one tensor")

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry (one token, or one compressed entry) across the group's tensors."""
        return sum(t.slot_bytes for t in self.tensors)

    def compatible(self, other: CacheGroup) -> bool:
        """Whether the two can share block tables (same kind, window and rate)."""
        return (self.kind, self.window, self.tokens_per_entry) == (
            other.kind,
            other.window,
            other.tokens_per_entry,
        )

    def layout(self) -> str:
        """Part of the model fingerprint: a cache of another layout must never match."""
        shapes = ",".join(f"{t.slot_shape}:{t.dtype}" for t in self.tensors)
        return f"{self.kind}/{self.window}/{self.tokens_per_entry}[{shapes}]"


def merge_groups(groups: list[CacheGroup]) -> list[CacheGroup]:
    """Fold compatible groups (e.g. a draft model's full group into the target's) into one, so
    they share block tables; the order of first appearance is kept."""
    merged: list[CacheGroup] = []
    for group in groups:
        for i, existing in enumerate(merged):
            if existing.compatible(group):
                merged[i] = CacheGroup(
                    existing.kind,
                    existing.tensors + group.tensors,
                    existing.window,
                    existing.tokens_per_entry,
                )
                break
        else:
            merged.append(group)
    return merged


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """A cache group with its share of the budget."""

    group: CacheGroup
    num_blocks: int
    entries_per_block: int

    @property
    def block_tokens(self) -> int:
        """Tokens one block covers."""
        return self.entries_per_block * self.group.tokens_per_entry

    @property
    def block_bytes(self) -> int:
        return self.entries_per_block * self.group.entry_bytes

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.entries_per_block


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Every cache group of an engine, sized. `block_size` is the prefix-hash granularity in
    tokens; every group's block covers a multiple of it."""

    block_size: int
    groups: tuple[GroupLayout, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        return sum(g.num_blocks * g.block_bytes for g in self.groups)

    @property
    def bytes_per_token(self) -> float:
        """Bytes one more token of context adds to groups that grow with the context (full and
        compressed); sliding groups are bounded by their window."""
        return sum(
            g.group.entry_bytes / g.group.tokens_per_entry for g in self.groups if g.group.kind != "sliding"
        )

    def fingerprint(self) -> str:
        return ";".join(g.group.layout() for g in self.groups)


def _entries_per_block(group: CacheGroup, block_size: int) -> int:
    rate = group.tokens_per_entry
    if rate == 1:
        return block_size
    if block_size % rate and rate % block_size:
        raise ValueError(
            f"compressed cache group: block_size {block_size} and tokens_per_entry {rate} must divide one another"
        )
    return max(block_size // rate, 1)


def _blocks_for(layout_group: GroupLayout, tokens: int, max_num_seqs: int, max_batched_tokens: int) -> int:
    """Blocks a group needs when the engine holds `tokens` tokens of context in all."""
    group, per_block = layout_group.group, layout_group.block_tokens
    if group.kind == "sliding":
        assert group.window is not None
        # Each sequence holds at most its window (plus the partial blocks at both ends); one
        # step's new tokens are written before older ones leave the window.
        bounded = max_num_seqs * (cdiv(group.window - 1, per_block) + 2) + cdiv(max_batched_tokens, per_block)
        return min(cdiv(tokens, per_block), bounded)
    return cdiv(tokens, per_block)


def plan_cache_layout(
    groups: list[CacheGroup],
    block_size: int,
    *,
    budget_bytes: int | None = None,
    num_blocks: int | None = None,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
) -> CacheLayout:
    """Size every group from one budget: the largest token capacity T whose blocks in every group
    fit `budget_bytes`, or, with `num_blocks`, the capacity of that many blocks of the first
    group. A single full group gets budget // (block_size * bytes per token) blocks."""
    groups = merge_groups(groups)
    sized = [GroupLayout(g, 1, _entries_per_block(g, block_size)) for g in groups]

    def blocks(tokens: int) -> list[int]:
        return [max(_blocks_for(g, tokens, max_num_seqs, max_num_batched_tokens), 1) for g in sized]

    def cost(tokens: int) -> int:
        return sum(n * g.block_bytes for n, g in zip(blocks(tokens), sized))

    if num_blocks is not None:
        capacity = num_blocks * sized[0].block_tokens
    else:
        if budget_bytes is None:
            raise ValueError("plan_cache_layout needs budget_bytes or num_blocks")
        # Largest multiple of the first group's block that fits (cost is monotone in tokens).
        step = sized[0].block_tokens
        low, high = 1, max(budget_bytes // max(min(g.block_bytes for g in sized), 1), 1) + 1
        while low < high:
            middle = (low + high + 1) // 2
            if cost(middle * step) <= budget_bytes:
                low = middle
            else:
                high = middle - 1
        capacity = low * step
    return CacheLayout(
        block_size,
        tuple(GroupLayout(g.group, n, g.entries_per_block) for g, n in zip(sized, blocks(capacity))),
    )
