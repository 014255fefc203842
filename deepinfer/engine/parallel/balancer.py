"""Which data-parallel rank a new request goes to: the one that already holds the longest run of
its prompt's blocks (prefix-cache aware, by the same chained block hashes the KV manager
indexes), unless that rank carries markedly more load than the least loaded one. Torch-free.

The balancer remembers, per rank, the block hashes of the prompts it sent there (a bounded LRU,
about the rank's KV capacity), so it needs no answer from the ranks to route; a rank's load is
its running + waiting sequences from its latest stats plus what was sent since.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.engine.kv_cache.prefix import extend_block_hashes


@dataclass(slots=True)
class RankLoad:
    reported: int = 0  # running + waiting at the latest stats
    sent: int = 0  # sequences sent since those stats


class DataParallelBalancer:
    def __init__(self, num_ranks: int, block_size: int, capacity_blocks: int, max_imbalance: int = 4) -> None:
        """`max_imbalance`: how many more sequences than the least loaded rank a prefix hit may
        cost before the request goes to the least loaded rank instead."""
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.capacity = max(capacity_blocks, 1)
        self.max_imbalance = max_imbalance
        self.cached: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]
        self.loads = [RankLoad() for _ in range(num_ranks)]
        self.num_routed = [0] * num_ranks
        self.num_prefix_routed = 0

    def load(self, rank: int) -> int:
        return self.loads[rank].reported + self.loads[rank].sent

    def choose(self, token_ids: list[int], root: bytes, num_seqs: int = 1) -> int:
        """The rank for a prompt (hashed from `root`, its namespace); records the choice."""
        hashes: list[bytes] = []
        extend_block_hashes(hashes, root, token_ids, self.block_size)
        matched = [self._matched(rank, hashes) for rank in range(self.num_ranks)]
        least = min(range(self.num_ranks), key=lambda r: (self.load(r), r))
        best = max(range(self.num_ranks), key=lambda r: (matched[r], -self.load(r), -r))
        rank = least
        if matched[best] > matched[least] and self.load(best) - self.load(least) <= self.max_imbalance:
            rank = best
            self.num_prefix_routed += 1
        self._remember(rank, hashes)
        self.loads[rank].sent += num_seqs
        self.num_routed[rank] += 1
        return rank

    def _matched(self, rank: int, hashes: list[bytes]) -> int:
        cached = self.cached[rank]
        count = 0
        for h in hashes:
            if h not in cached:
                break
            count += 1
        return count

    def _remember(self, rank: int, hashes: list[bytes]) -> None:
        cached = self.cached[rank]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    def report(self, rank: int, running_and_waiting: int) -> None:
        """A rank's stats after a step: its load is now known."""
        self.loads[rank] = RankLoad(running_and_waiting, 0)

    def forget(self) -> None:
        """The ranks' prefix caches were reset."""
        for cached in self.cached:
            cached.clear()
