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

A chunk may be cut short at any valid hit length inside it (a multiple of the lcm, `parts(chunk,
end)`): the direct PD handoff (kv_pd.py) sends a prompt as its whole chunks and then such a piece
for the tail, so the decoder recomputes less than one lcm of it. The store keeps whole chunks
only (a piece is no shared prefix's end). `read_chunk` and `install_chunk` are the one way chunks
leave and enter device blocks, for the store, the host tier and the direct handoff alike.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import lcm
from typing import Protocol

import numpy as np

from deepinfer.engine.kv_cache.groups import FullAttentionGroup, SlidingWindowGroup
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.sequence import Sequence

CHUNK_FORMAT = "deepinfer-kv-chunk-v2"  # v1: one cache group, [tensors, tokens, *slot] arrays


class BlockTransfer(Protocol):
    """The caches' side: one group's KV of whole blocks to and from host bytes
    [blocks, block_bytes] (uint8)."""

    def read_blocks(self, group: int, block_ids: list[int]) -> np.ndarray: ...

    def write_blocks(self, group: int, block_ids: list[int], kv: np.ndarray) -> None: ...


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
        self.hit_tokens = lcm(*(g.block_tokens for g in groups))  # the valid ends of a piece
        for g in groups:
            if self.chunk_tokens % g.block_tokens:
                raise ValueError(
                    f"kv_chunk_blocks: a stored chunk of {blocks_per_chunk} blocks ({self.chunk_tokens} "
                    f"tokens) must end on a block of every cache group; the {g.layout.group.kind} group's "
                    f"blocks cover {g.block_tokens} tokens"
                )

    def parts(self, chunk: int, end: int | None = None) -> list[GroupPart]:
        """Every group's blocks in chunk `chunk`, in group order; `end` (tokens, a multiple of
        `hit_tokens` inside the chunk) cuts it short there."""
        whole = (chunk + 1) * self.chunk_tokens
        if end is None:
            end = whole
        assert chunk * self.chunk_tokens < end <= whole and end % self.hit_tokens == 0, (chunk, end)
        parts = []
        for index, g in enumerate(self.groups):
            last = end // g.block_tokens
            if isinstance(g, SlidingWindowGroup):
                first = g.first_needed(end)
            else:
                first = chunk * self.chunk_tokens // g.block_tokens
            parts.append(GroupPart(index, range(first, last), g.layout.block_bytes))
        return parts

    def pieces(self, num_tokens: int) -> list[tuple[int, int]]:
        """(chunk, end in tokens) of the whole chunks in the first `num_tokens` tokens, then of the
        piece of the next chunk up to the last valid hit length, if any."""
        ends = range(self.chunk_tokens, num_tokens + 1, self.chunk_tokens)
        pieces = [(chunk, end) for chunk, end in enumerate(ends)]
        tail = num_tokens // self.hit_tokens * self.hit_tokens
        if tail > len(pieces) * self.chunk_tokens:
            pieces.append((len(pieces), tail))
        return pieces

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


def read_chunk(
    kv: KVCacheManager, transfer: BlockTransfer, seq: Sequence, parts: list[GroupPart]
) -> np.ndarray | None:
    """A chunk's payload, its groups' blocks off the device (found through the prefix-cache
    index, so a finished sequence's freed blocks count); None if any is not indexed (not computed
    yet, or evicted)."""
    blocks = []
    for part in parts:
        group = kv.groups[part.group]
        ids = [group.pool.lookup(group.block_key(seq.block_hashes, i)) for i in part.block_indices]
        if None in ids:
            return None
        blocks.append(ids)
    return np.concatenate(
        [transfer.read_blocks(p.group, ids).reshape(-1).view(np.uint8) for p, ids in zip(parts, blocks)]
    )


def install_chunk(
    kv: KVCacheManager, transfer: BlockTransfer, seq: Sequence, parts: list[GroupPart], payload: np.ndarray
) -> int | None:
    """Write a chunk's payload into free blocks of every group (those the device lacks) and index
    them as `seq`'s; returns how many blocks it wrote, or None (and writes nothing) when some
    group has too few free blocks: a prefetch never evicts running work. A payload of another
    size than the layout's is a ValueError."""
    data = payload.reshape(-1).view(np.uint8)
    if data.size != sum(p.num_bytes for p in parts):
        raise ValueError(f"a KV chunk of {data.size} bytes does not fit this layout")
    todo = []
    for part in parts:
        group = kv.groups[part.group]
        missing = [
            i for i in part.block_indices if group.pool.lookup(group.block_key(seq.block_hashes, i)) is None
        ]
        todo.append((part, missing))
    if any(len(missing) > kv.groups[p.group].pool.num_free for p, missing in todo):
        return None
    offset = 0
    written = 0
    for part, missing in todo:
        rows = data[offset : offset + part.num_bytes].reshape(len(part.block_indices), part.block_bytes)
        offset += part.num_bytes
        if not missing:
            continue
        pool = kv.groups[part.group].pool
        blocks = [pool.allocate() for _ in missing]
        first = part.block_indices.start
        try:
            whole = len(missing) == len(part.block_indices)  # the usual case: no copy of the rows
            transfer.write_blocks(part.group, blocks, rows if whole else rows[[i - first for i in missing]])
        except Exception:
            pool.release(blocks)
            raise
        kv.install_blocks(seq, part.group, missing, blocks)
        written += len(missing)
    return written
