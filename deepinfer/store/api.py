"""The engine-facing KV store interface and the chunk grouping.

Grouping: a chunk is `blocks_per_chunk` (C) consecutive full blocks of one sequence, starting at
block 0, so chunk i holds blocks [i*C, (i+1)*C). Its key is the prefix hash of its last block,
which already identifies the whole prefix up to there (the hash is chained from the namespace
through every earlier block). Only full chunks are stored; a shorter tail stays on the device.
Larger chunks mean fewer, bigger objects (good for shared file systems and Redis round trips)
at the cost of coarser reuse: up to C*block_size - 1 tokens of a matched prefix are recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np


def chunk_keys(block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
    """Key of every full chunk, in order: the hash of each chunk's last block."""
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    return [block_hashes[end - 1] for end in range(blocks_per_chunk, len(block_hashes) + 1, blocks_per_chunk)]


class KVStore(Protocol):
    """Prefix KV chunks that outlive requests, processes and machines.

    Every failure is a miss: the engine recomputes. Nothing here raises for a store that is
    down, slow or damaged; only bad arguments raise (ValueError/TypeError naming the field).
    """

    @property
    def blocks_per_chunk(self) -> int: ...

    def chunk_keys(self, block_hashes: Sequence[bytes]) -> list[bytes]: ...

    def lookup(self, keys: Sequence[bytes], namespace: bytes) -> int:
        """How many chunks, from the first, are available. A hint: `load` is authoritative."""
        ...

    def load(
        self, keys: Sequence[bytes], namespace: bytes, arrived: list[np.ndarray] | None = None
    ) -> Future[list[np.ndarray]]:
        """Fetch chunks in order in the background; the result stops at the first chunk that
        could not be delivered (it may be shorter than `lookup` promised). `arrived`, if given,
        is that result list itself: each chunk is appended as it is delivered, before the future
        completes, so a caller can use the first chunks while later ones are read."""
        ...

    def save(
        self,
        key: bytes,
        namespace: bytes,
        payload: np.ndarray | bytes,
        *,
        num_tokens: int,
        traffic_class: str,
    ) -> bool:
        """Keep one chunk: host tier now, persistent store in the background. Never blocks on
        the store; False when the persistent write was dropped. The store keeps a reference to
        the array: do not modify it afterwards."""
        ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def metrics_snapshot(self) -> dict[str, float]: ...

    def close(self) -> None: ...
