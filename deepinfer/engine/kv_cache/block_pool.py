"""The pool of fixed-size KV blocks of one cache group: reference counts, the prefix-hash index and
LRU eviction.

Plain Python data only; the runner owns the tensors. A block with ref_count 0 sits in the free
queue; if it still carries a prefix hash it can be revived by a cache hit until it is reused.
Eviction takes the head of the free queue: blocks without a hash first (they hold nothing
reusable), then hashed blocks in least-recently-freed order. A sequence frees its blocks tail
first, so within one chain the tail is evicted before the head.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.transport.kv_event_log import KVEventLog


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    prefix_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered free queue: head is evicted first. Values are unused (OrderedDict as a linked set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.num_evictions = 0  # hashed blocks reused for other content
        self.events = events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that currently carry a reusable prefix hash (in use or free)."""
        return len(self._by_hash)

    def free_order(self) -> list[int]:
        """Block ids in the order they would be evicted (for tests and debugging)."""
        return list(self._free)

    def lookup(self, prefix_hash: bytes) -> int | None:
        return self._by_hash.get(prefix_hash)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV block pool exhausted")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.prefix_hash is not None:
            del self._by_hash[block.prefix_hash]
            if self.events is not None:
                self.events.removed([block.prefix_hash])
            block.prefix_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference on a block (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, in the order given."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.prefix_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def register(self, block_id: int, prefix_hash: bytes) -> bool:
        """Mark a full, computed block as reusable under `prefix_hash`; True when it is newly indexed.

        If another block already holds that hash, the index keeps the existing one: both hold the
        same KV, and the duplicate simply stays unindexed until it is freed.
        """
        block = self.blocks[block_id]
        if block.prefix_hash is not None or prefix_hash in self._by_hash:
            return False
        block.prefix_hash = prefix_hash
        self._by_hash[prefix_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only allowed when no block is in use, like vLLM's reset."""
        if self.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.prefix_hash = None
        self._by_hash.clear()
        if self.events is not None:
            self.events.cleared()
        return True
