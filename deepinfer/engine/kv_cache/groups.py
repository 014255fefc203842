"""One small manager per cache-group kind, each over its own block pool. Torch-free.

A group manager knows how its blocks map to tokens and which of them a sequence still needs;
the coordinator (manager.py) drives them together so that one admission, one allocation and one
preemption decision cover every group. Per sequence a group keeps a block table (a list of block
ids, `NULL_BLOCK` where a block was released early) and how many of its leading blocks are indexed
in the prefix cache. Group managers mutate only the table and counter passed to them and their
own pool; none of them is safe to call from more than one thread.
"""

from __future__ import annotations

from deepinfer.cache_layout import GroupLayout
from deepinfer.engine.kv_cache.block_pool import BlockPool
from deepinfer.transport.kv_event_log import KVEventLog
from deepinfer.utils import cdiv

NULL_BLOCK = -1  # a table entry whose block was released (out of a sliding window)


class FullAttentionGroup:
    """Every past entry stays until the sequence ends: full attention, or compressed entries
    (one per `tokens_per_entry` tokens; a block then covers `block_tokens` tokens).

    Block i of a sequence covers tokens [i * block_tokens, (i + 1) * block_tokens); once full and
    computed it is indexed under the prefix hash of the last hash block it covers."""

    prefix_closed = True  # a hit of L tokens implies hits of every shorter length

    def __init__(self, layout: GroupLayout, hash_block_size: int, events: KVEventLog | None = None) -> None:
        self.layout = layout
        self.block_tokens = layout.block_tokens
        if self.block_tokens % hash_block_size:
            raise ValueError(
                f"a {layout.group.kind} group's block of {self.block_tokens} tokens is not a multiple of "
                f"the block size {hash_block_size}"
            )
        self.hashes_per_block = self.block_tokens // hash_block_size
        self.pool = BlockPool(layout.num_blocks, events)

    # -- queries (no mutation) --------------------------------------------------------------------

    def block_key(self, hashes: list[bytes], index: int) -> bytes:
        """The prefix hash block `index` of a sequence is indexed under."""
        return hashes[(index + 1) * self.hashes_per_block - 1]

    def hit_tokens(self, hashes: list[bytes], limit: int) -> int:
        """Longest cached prefix (in tokens, a multiple of block_tokens, at most `limit`)."""
        count = 0
        while (count + 1) * self.block_tokens <= limit and self.pool.lookup(
            self.block_key(hashes, count)
        ) is not None:
            count += 1
        return count * self.block_tokens

    def hit_blocks(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """The table a sequence starts with after a hit of `num_tokens` (a valid hit length)."""
        blocks = []
        for i in range(num_tokens // self.block_tokens):
            block_id = self.pool.lookup(self.block_key(hashes, i))
            assert block_id is not None, "hit_blocks past the hit length"
            blocks.append(block_id)
        return blocks

    def needs_copy(self, table: list[int], num_computed: int) -> bool:
        """A forked sequence about to write into a partial block it shares gets its own copy."""
        if not table:
            return False
        written_in_last = num_computed - (len(table) - 1) * self.block_tokens
        return 0 < written_in_last < self.block_tokens and self.pool.blocks[table[-1]].ref_count > 1

    def releasable(self, table: list[int], num_computed: int) -> list[int]:
        """Blocks of the table no future step reads (none, for full attention)."""
        return []

    def blocks_needed(self, table: list[int], num_computed: int, num_new: int) -> int:
        """Free blocks `allocate(table, num_computed, num_new)` takes from the pool, net of the
        blocks it gives back first."""
        needed = cdiv(num_computed + num_new, self.block_tokens) - len(table)
        if num_new and self.needs_copy(table, num_computed):
            needed += 1
        freed = sum(1 for b in self.releasable(table, num_computed) if self.pool.blocks[b].ref_count == 1)
        return max(needed, 0) - freed

    # -- mutations -----------------------------------------------------------------------------------

    def attach_hit(self, table: list[int], blocks: list[int]) -> None:
        """Take a reference on each hit block and start the table with them."""
        for block_id in blocks:
            if block_id != NULL_BLOCK:
                self.pool.touch(block_id)
        table.extend(blocks)

    def allocate(self, table: list[int], num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """Room for `num_new` more tokens after `num_computed`; returns the block copies
        (src, dst) the runner applies before the step (copy-on-write of a shared partial block)."""
        self.release(table, self.releasable(table, num_computed))
        copies = []
        if num_new and self.needs_copy(table, num_computed):
            shared = table[-1]
            private = self.pool.allocate()
            copies.append((shared, private))
            self.pool.release([shared])
            table[-1] = private
        total = cdiv(num_computed + num_new, self.block_tokens)
        while len(table) < total:
            table.append(self.pool.allocate())
        return copies

    def release(self, table: list[int], block_ids: list[int]) -> None:
        """Give back blocks of the table early (their entries become NULL_BLOCK)."""
        if not block_ids:
            return
        gone = set(block_ids)
        for i, block_id in enumerate(table):
            if block_id in gone:
                table[i] = NULL_BLOCK
        self.pool.release(block_ids)

    def register(
        self,
        table: list[int],
        hashes: list[bytes],
        num_computed: int,
        num_registered: int,
        token_ids: list[int],
    ) -> int:
        """Index every full, computed block; returns the new count of indexed leading blocks.
        Blocks newly indexed are reported to the pool's event log, with their tokens."""
        num_full = min(num_computed // self.block_tokens, len(hashes) // self.hashes_per_block)
        indexed = [
            i
            for i in range(num_registered, num_full)
            if table[i] != NULL_BLOCK and self.pool.register(table[i], self.block_key(hashes, i))
        ]
        if indexed and self.pool.events is not None:
            self.log_stored(hashes, indexed, token_ids)
        return max(num_full, num_registered)

    def log_stored(self, hashes: list[bytes], indexed: list[int], token_ids: list[int]) -> None:
        """One Stored event per run of consecutive newly indexed blocks."""
        assert self.pool.events is not None
        runs: list[list[int]] = []
        for i in indexed:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        size = self.block_tokens
        for run in runs:
            first, last = run[0], run[-1]
            self.pool.events.stored(
                [self.block_key(hashes, i) for i in run],
                self.block_key(hashes, first - 1) if first else None,
                token_ids[first * size : (last + 1) * size],
                size,
            )

    def fork(self, table: list[int]) -> list[int]:
        for block_id in table:
            if block_id != NULL_BLOCK:
                self.pool.touch(block_id)
        return list(table)

    def trim(self, table: list[int], num_computed: int) -> None:
        """Release the blocks past the computed tokens, tail first."""
        keep = cdiv(num_computed, self.block_tokens)
        if len(table) > keep:
            self.pool.release([b for b in reversed(table[keep:]) if b != NULL_BLOCK])
            del table[keep:]

    def free(self, table: list[int]) -> None:
        """Release every block, tail first, so a chain's tail is evicted before its head."""
        self.pool.release([b for b in reversed(table) if b != NULL_BLOCK])
        table.clear()


class SlidingWindowGroup(FullAttentionGroup):
    """One entry per token; a query at position p sees positions p - window + 1 .. p. Blocks that
    no later query can see are released while the sequence runs (they stay in the prefix cache
    until evicted), so a sequence holds about window / block_size blocks however long it grows.

    A prefix hit of length L needs only the blocks holding positions L - window + 1 .. L - 1."""

    prefix_closed = False

    def __init__(self, layout: GroupLayout, hash_block_size: int, events: KVEventLog | None = None) -> None:
        super().__init__(layout, hash_block_size, events)
        if self.hashes_per_block != 1:
            raise ValueError("a sliding-window group's blocks must be of the block size")
        assert layout.group.window is not None
        self.window = layout.group.window

    def first_needed(self, next_position: int) -> int:
        """Index of the first block the query at `next_position` (and any later one) reads."""
        return max(next_position - self.window + 1, 0) // self.block_tokens

    def releasable(self, table: list[int], num_computed: int) -> list[int]:
        return [b for b in table[: self.first_needed(num_computed)] if b != NULL_BLOCK]

    def hits_at(self, hashes: list[bytes], num_tokens: int) -> bool:
        """Whether a hit of `num_tokens` tokens has every block its next query reads."""
        if num_tokens == 0:
            return True
        last = (num_tokens - 1) // self.block_tokens
        return all(
            self.pool.lookup(self.block_key(hashes, i)) is not None
            for i in range(self.first_needed(num_tokens), last + 1)
        )

    def hit_tokens(self, hashes: list[bytes], limit: int) -> int:
        """Longest hit length (multiple of the block size, at most `limit`) this group can serve."""
        tokens = limit // self.block_tokens * self.block_tokens
        while tokens and not self.hits_at(hashes, tokens):
            tokens -= self.block_tokens
        return tokens

    def hit_blocks(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        first = self.first_needed(num_tokens)
        blocks = [NULL_BLOCK] * first
        for i in range(first, num_tokens // self.block_tokens):
            block_id = self.pool.lookup(self.block_key(hashes, i))
            assert block_id is not None, "hit_blocks past the hit length"
            blocks.append(block_id)
        return blocks


def make_group_manager(
    layout: GroupLayout, hash_block_size: int, events: KVEventLog | None = None
) -> FullAttentionGroup:
    if layout.group.kind == "sliding":
        return SlidingWindowGroup(layout, hash_block_size, events)
    return FullAttentionGroup(layout, hash_block_size, events)
