"""What one stored KV chunk holds, for any set of cache groups. Torch-free.

A chunk is C consecutive full hash blocks (`--kv-chunk-blocks`) of a sequence, keyed by the
prefix hash of its last block; chunk k covers tokens [k * T, (k + 1) * T) with T = C *
block_size. It keeps, per cache group, exactly what the next token after its end needs, i.e.
what the device prefix cache requires of a hit of (k + 1) * T tokens (manager.py):

- a full or compressed group (prefix-closed: a hit needs every entry before it): the group's
  blocks covering the chunk's own tokens. Chunks 0..k together hold every entry up to the end;
  for DeepSeek-V4 these are the CSA/HCA entries and the indexer keys.
- a sliding group: the blocks the query at the chunk's end reads, i.e. those holding positions
  end - window + 1 .. end - 1 (possibly reaching into earlier chunks, stored again here: a hit
  needs only the last chunk's window, whichever chunk is last). For V4 these are the raw K = V
  rows of the last window and, in the shorter-window group, the compressors' and the indexer's
  per-token state of the compression windows still open at the boundary: that state is declared
  as sliding-window rows, so the compressor state at the boundary is what this group keeps.

T must be a multiple of every group's block tokens (the lcm the device cache puts hits on), so
chunk boundaries are valid hit lengths. The payload is the groups' blocks as raw bytes, group
after group, each block as KVCaches.read_blocks lays it out; the split is known from the
layout and the chunk index, and the store namespace folds the layout in (`store_namespace`), so
a chunk of another model's groups (a Llama or DeepSeek-V3 cache, another window or rate, another
chunk size) can never be read as this one's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from deepinfer.engine.kv_cache.groups import FullAttentionGroup, SlidingWindowGroup

CHUNK_FORMAT = "deepinfer-kv-chunk-v2"  # v1: one cache group, [tensors, tokens, *slot] arrays


@dataclass(frozen=True, slots=True)
class GroupPart:
    """One group's share of a chunk: its block indices (in the sequence's table of that group)."""

    group: int
    block_indices: range
    block_bytes: int

    @property
    def num_bytes(self) -> int:
        return len(self.block_indices) * self.block_bytes


class ChunkLayout:
    """Which blocks of which group make up chunk k, and the namespace its objects live in."""

    def __init__(self, groups: list[FullAttentionGroup], block_size: int, blocks_per_chunk: int) -> None:
        self.groups = groups
        self.chunk_tokens = blocks_per_chunk * block_size
        for g in groups:
            if self.chunk_tokens % g.block_tokens:
                raise ValueError(
                    f"kv_chunk_blocks: a stored chunk of {blocks_per_chunk} blocks ({self.chunk_tokens} "
                    f"tokens) must end on a block of every cache group; the {g.layout.group.kind} group's "
                    f"blocks cover {g.block_tokens} tokens"
                )

    def parts(self, chunk: int) -> list[GroupPart]:
        """Every group's blocks in chunk `chunk`, in group order."""
        end = (chunk + 1) * self.chunk_tokens
        parts = []
        for index, g in enumerate(self.groups):
            last = end // g.block_tokens
            if isinstance(g, SlidingWindowGroup):
                first = g.first_needed(end)
            else:
                first = chunk * self.chunk_tokens // g.block_tokens
            parts.append(GroupPart(index, range(first, last), g.layout.block_bytes))
        return parts

    def describe(self) -> str:
        """The chunk format: its version, size and each group's layout and kept blocks."""
        groups = ";".join(
            f"{g.layout.group.layout()}x{g.layout.entries_per_block}:"
            f"{'window' if isinstance(g, SlidingWindowGroup) else 'all'}"
            for g in self.groups
        )
        return f"{CHUNK_FORMAT}|{self.chunk_tokens}|{groups}"

    def store_namespace(self, prefix_root: bytes) -> bytes:
        """The namespace of a sequence's chunks in the store: its prefix root (model, cache salt)
        together with the chunk format, so only engines with identical groups share objects."""
        h = hashlib.sha256(CHUNK_FORMAT.encode() + b"\0")
        h.update(prefix_root)
        h.update(self.describe().encode())
        return h.digest()
