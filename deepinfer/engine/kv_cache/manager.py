"""KV-cache manager: per-sequence block tables over the block pool, prefix hits, copy-on-write.

Torch-free. The scheduler asks it for room ("can this sequence take N more tokens?"), the runner
receives block tables and the copy operations it must apply before the step's forward.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.engine.kv_cache.block_pool import BlockPool
from deepinfer.engine.kv_cache.prefix import extend_block_hashes
from deepinfer.sequence import Sequence
from deepinfer.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._pending_copies: list[tuple[int, int]] = []
        # Called after a sequence's indexed blocks grew (the KV offloader saves completed chunks).
        self.on_blocks_cached: Callable[[Sequence], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def update_hashes(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.prefix_root, seq.token_ids, self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks for a sequence about to be admitted.

        At least the last token is always left to compute, so the step has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for prefix_hash in seq.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(prefix_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int) -> int:
        computed = seq.num_computed_tokens + num_hit_blocks * self.block_size
        needed = cdiv(computed + num_new_tokens, self.block_size) - len(seq.block_table) - num_hit_blocks
        if self._needs_copy_on_write(seq, num_new_tokens):
            needed += 1
        return max(needed, 0)

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """A forked sequence about to write into a partial block it shares must get its own copy."""
        if not seq.block_table or num_new_tokens == 0:
            return False
        last = seq.block_table[-1]
        written_in_last = seq.num_computed_tokens - (len(seq.block_table) - 1) * self.block_size
        return 0 < written_in_last < self.block_size and self.pool.blocks[last].ref_count > 1

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks `allocate(seq, num_new_tokens)` would take (copy-on-write included)."""
        return self._blocks_needed(seq, num_new_tokens, 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit_blocks: list[int] | None = None) -> bool:
        hit_blocks = hit_blocks or []
        revived = sum(1 for b in hit_blocks if self.pool.blocks[b].ref_count == 0)
        return self._blocks_needed(seq, num_new_tokens, len(hit_blocks)) <= self.pool.num_free - revived

    def allocate(self, seq: Sequence, num_new_tokens: int, hit_blocks: list[int] | None = None) -> None:
        """Give `seq` room for `num_new_tokens` more tokens (call can_allocate first).

        `hit_blocks` is passed on admission (possibly empty): it counts as one cache lookup.
        """
        if hit_blocks is not None and self.enable_prefix_caching:
            stats = self.pool.stats
            stats.lookups += 1
            stats.queried_tokens += seq.num_tokens
            stats.hit_tokens += len(hit_blocks) * self.block_size
        if hit_blocks:
            for block_id in hit_blocks:
                self.pool.touch(block_id)
            seq.block_table.extend(hit_blocks)
            seq.num_computed_tokens += len(hit_blocks) * self.block_size
        if self._needs_copy_on_write(seq, num_new_tokens):
            shared = seq.block_table[-1]
            private = self.pool.allocate()
            self._pending_copies.append((shared, private))
            self.pool.release([shared])
            seq.block_table[-1] = private
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self.pool.allocate())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent (copy-on-write on its first write)."""
        for block_id in parent.block_table:
            self.pool.touch(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Index every full block whose tokens have all been computed (prompt or decode)."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        if num_full <= seq.num_registered_blocks:
            return
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = num_full
        if self.on_blocks_cached is not None:
            self.on_blocks_cached(seq)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past a sequence's computed tokens, tail first (speculative decoding
        reserves slots for draft tokens; those of rejected drafts are given back)."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(list(reversed(seq.block_table[keep:])))
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks tail first, so a chain's tail is evicted before its head."""
        self.pool.release(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
