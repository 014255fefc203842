"""KV-cache manager: one block table per cache group per sequence, over one group manager per
group, with prefix hits, copy-on-write and early release of out-of-window blocks. Torch-free.

The scheduler asks it for room ("can this sequence take N more tokens?") and the runner receives
the block tables and the copies it must apply before the step's forward. Every decision covers
all groups at once: a sequence is admitted, grown or preempted for all of its caches together.

Contract (what each method mutates; all are called from the engine's one thread):
- `find_cached_prefix`: extends `seq.block_hashes`; nothing else.
- `can_allocate`, `fits`, `blocks_needed`: pure queries.
- `allocate`: the sequence's tables and computed-token count (hit blocks count as computed),
  the pools, the pending copies, the lookup statistics (on admission).
- `fork`: the child's tables, hashes and counters (references on the parent's blocks).
- `cache_computed_blocks`: the sequence's hashes and registered counts, the pools' indexes.
- `trim`, `free`: the sequence's tables (and `free` its counters), the pools.
- `take_copies`: empties the pending copies.
- `install_blocks`: one group's pool and index (blocks filled by a KV connector).

With an event log (passed at construction), the first group's pool reports what it indexes and
drops: that group's blocks are the ones a router outside the engine can credit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm

from deepinfer.cache_layout import CacheLayout
from deepinfer.engine.kv_cache.groups import NULL_BLOCK, FullAttentionGroup, make_group_manager
from deepinfer.engine.kv_cache.prefix import extend_block_hashes
from deepinfer.sequence import Sequence
from deepinfer.transport.kv_event_log import KVEventLog

# (group, source block, destination block): a copy the runner makes before the step's forward.
BlockCopy = tuple[int, int, int]


@dataclass(slots=True)
class PrefixCacheStats:
    lookups: int = 0  # sequences that looked up the cache on admission
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class PrefixHit:
    """Cached tokens a sequence can start from, and the blocks holding them in each group."""

    num_tokens: int = 0
    blocks: list[list[int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self, layout: CacheLayout, enable_prefix_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size  # prefix-hash granularity, in tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.groups: list[FullAttentionGroup] = [
            make_group_manager(g, layout.block_size, events if i == 0 else None)
            for i, g in enumerate(layout.groups)
        ]
        # A hit must end on a block boundary of every group.
        self.hit_granularity = lcm(*(g.block_tokens for g in self.groups))
        self.stats = PrefixCacheStats()
        self._pending_copies: list[BlockCopy] = []

    # -- capacity ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(g.pool.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.pool.num_free for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use (the one that preempts first)."""
        return max(1.0 - g.pool.num_free / g.pool.num_blocks for g in self.groups)

    @property
    def num_evictions(self) -> int:
        return sum(g.pool.num_evictions for g in self.groups)

    @property
    def num_cached_blocks(self) -> int:
        return sum(g.pool.num_cached for g in self.groups)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.groups]
            seq.num_registered = [0] * len(self.groups)
        return seq.block_tables

    # -- prefix hits -------------------------------------------------------------------------------

    def update_hashes(self, seq: Sequence) -> None:
        extend_block_hashes(
            seq.block_hashes, seq.prefix_root, seq.token_ids, self.block_size, seq.request.images
        )

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """Longest cached prefix every group can serve, for a sequence about to be admitted.

        At least the last token is always left to compute, so the step has logits to sample from."""
        if not self.enable_prefix_caching:
            return PrefixHit(0, [[] for _ in self.groups])
        self.update_hashes(seq)
        hashes = seq.block_hashes
        tokens = (seq.num_tokens - 1) // self.hit_granularity * self.hit_granularity
        for g in self.groups:
            tokens = g.hit_tokens(hashes, tokens)
        tokens = tokens // self.hit_granularity * self.hit_granularity
        # Full-attention hits are prefix-closed; a sliding group also needs the window in front
        # of the hit, which a shorter hit may lack: step down until every group has it.
        windowed = [g for g in self.groups if not g.prefix_closed]
        while tokens and not all(g.hits_at(hashes, tokens) for g in windowed):
            tokens -= self.hit_granularity
        return PrefixHit(tokens, [g.hit_blocks(hashes, tokens) for g in self.groups])

    # -- room for new tokens -------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Free blocks per group that `allocate(seq, num_new_tokens)` would take."""
        tables = self._tables(seq)
        return [
            g.blocks_needed(table, seq.num_computed_tokens, num_new_tokens)
            for g, table in zip(self.groups, tables)
        ]

    def fits(self, seq: Sequence, num_new_tokens: int, reserved: list[int] | None = None) -> bool:
        """Whether `seq` can grow by `num_new_tokens` with `reserved[g]` blocks of each group kept
        for others."""
        reserved = reserved or [0] * len(self.groups)
        return all(
            need + keep <= g.pool.num_free
            for need, keep, g in zip(self.blocks_needed(seq, num_new_tokens), reserved, self.groups)
        )

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        if hit is None or not hit.num_tokens:
            return self.fits(seq, num_new_tokens)
        computed = seq.num_computed_tokens + hit.num_tokens
        for g, table, blocks in zip(self.groups, self._tables(seq), hit.blocks):
            revived = sum(1 for b in blocks if b != NULL_BLOCK and g.pool.blocks[b].ref_count == 0)
            if g.blocks_needed(table + blocks, computed, num_new_tokens) > g.pool.num_free - revived:
                return False
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> None:
        """Give `seq` room for `num_new_tokens` more tokens (call can_allocate first).

        `hit` is passed on admission (possibly empty): it counts as one cache lookup, and its
        tokens count as computed."""
        tables = self._tables(seq)
        if hit is not None and self.enable_prefix_caching:
            self.stats.lookups += 1
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += hit.num_tokens
        if hit is not None and hit.num_tokens:
            for g, table, blocks in zip(self.groups, tables, hit.blocks):
                g.attach_hit(table, blocks)
            seq.num_computed_tokens += hit.num_tokens
        for index, (g, table) in enumerate(zip(self.groups, tables)):
            for src, dst in g.allocate(table, seq.num_computed_tokens, num_new_tokens):
                self._pending_copies.append((index, src, dst))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent (copy-on-write on its first write)."""
        child.block_tables = [g.fork(table) for g, table in zip(self.groups, self._tables(parent))]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered = list(parent.num_registered)

    def cache_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Index every full block whose tokens have all been computed (prompt or decode): of the
        first `num_computed` tokens (default: the sequence's computed tokens; async scheduling
        counts a step's tokens as computed before that step runs). Mutates the pools' index and
        `seq.block_hashes` / `seq.num_registered`."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        tables = self._tables(seq)
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        for i, (g, table) in enumerate(zip(self.groups, tables)):
            seq.num_registered[i] = g.register(
                table, seq.block_hashes, computed, seq.num_registered[i], seq.token_ids
            )

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past a sequence's computed tokens, tail first (speculative decoding
        reserves slots for draft tokens; those of rejected drafts are given back)."""
        for g, table in zip(self.groups, self._tables(seq)):
            g.trim(table, seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks tail first, so a chain's tail is evicted before its head."""
        for g, table in zip(self.groups, self._tables(seq)):
            g.free(table)
        seq.num_computed_tokens = 0
        seq.num_registered = [0] * len(self.groups)

    def install_blocks(
        self, seq: Sequence, group: int, block_indices: list[int], block_ids: list[int]
    ) -> None:
        """Index blocks a KV connector filled (taken with `allocate()` from group `group`'s pool)
        as `seq`'s blocks `block_indices` of that group, then release them: cached and free, tail
        first, like any freed chain, so admission finds them as ordinary hits. A block whose hash
        is indexed already stays unindexed and is simply free again."""
        manager = self.groups[group]
        hashes = seq.block_hashes
        indexed = [
            index
            for index, block_id in zip(block_indices, block_ids)
            if manager.pool.register(block_id, manager.block_key(hashes, index))
        ]
        if indexed and manager.pool.events is not None:
            manager.log_stored(hashes, indexed, seq.token_ids)
        manager.pool.release(list(reversed(block_ids)))

    def take_copies(self) -> list[BlockCopy]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only when no block is in use."""
        if self.num_used_blocks:
            return False
        return all(g.pool.reset_prefix_cache() for g in self.groups)
