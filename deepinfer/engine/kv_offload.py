"""Connects the device prefix cache to the KV tiers beyond it (host memory, a shared store).

Reads: when a request arrives, the longest run of stored chunks beyond what device memory already
holds is loaded in the background; the sequence waits (others keep running). When the load lands,
the chunks are written into free device blocks and indexed under their prefix hashes, so the
ordinary admission path finds them as device hits and computes only the rest.

Writes: when a sequence's computed, full blocks complete a chunk, the chunk's KV is copied off
the device (synchronously: the blocks may be reused after this step) and handed to the store's
write-behind queue, tagged with the request's traffic class for retention. The blocks are found
through the prefix-cache index, so a sequence that finished this step (its blocks freed but still
indexed) is saved like any other.

One KVConnector implementation (kv_connector.py). Models with one cache group only, for now.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.sequence import Sequence
from deepinfer.store import DEFAULT_TRAFFIC_CLASS, TieredKVStore

log = logging.getLogger(__name__)


class BlockTransfer(Protocol):
    """The caches' side: one group's KV of whole blocks to and from host arrays
    [tensors, tokens, *slot]."""

    def read_blocks(self, group: int, block_ids: list[int]) -> np.ndarray: ...

    def write_blocks(self, group: int, block_ids: list[int], kv: np.ndarray) -> None: ...


@dataclass(slots=True)
class _PendingLoad:
    seq: Sequence
    first_chunk: int
    future: Future[list[np.ndarray]]


class KVOffloader:
    def __init__(self, store: TieredKVStore, kv: KVCacheManager, transfer: BlockTransfer) -> None:
        if len(kv.groups) != 1:
            raise ValueError(
                "kv_store: the KV store holds models with one cache group; this model has "
                f"{len(kv.groups)} ({', '.join(g.layout.group.kind for g in kv.groups)})"
            )
        self.store = store
        self.kv = kv
        self.pool = kv.groups[0].pool
        self.transfer = transfer
        self.chunk_blocks = store.blocks_per_chunk
        self._pending: list[_PendingLoad] = []
        self.loaded_chunks = 0
        self.saved_chunks = 0

    def prefetch(self, seq: Sequence) -> None:
        """Start loading the stored chunks beyond the device hits; the sequence waits for them."""
        hits = self.kv.find_cached_prefix(seq).num_tokens // self.kv.block_size
        usable = (seq.num_tokens - 1) // self.kv.block_size  # the last token is always computed
        keys = self.store.chunk_keys(seq.block_hashes[:usable])
        first = hits // self.chunk_blocks
        seq.num_stored_chunks = first
        if first >= len(keys):
            return
        found = self.store.lookup(keys[first:], seq.prefix_root)
        if found == 0:
            return
        seq.num_pending += 1
        self._pending.append(
            _PendingLoad(seq, first, self.store.load(keys[first : first + found], seq.prefix_root))
        )

    def poll(self) -> None:
        """Install every finished load into device blocks and release its sequence."""
        still: list[_PendingLoad] = []
        for pending in self._pending:
            if not pending.future.done():
                still.append(pending)
                continue
            pending.seq.num_pending -= 1
            if pending.seq.is_finished:
                continue  # aborted while loading
            try:
                arrays = pending.future.result()
            except Exception:  # the store degrades to misses; the engine recomputes
                log.exception("loading KV from the store failed; recomputing")
                continue
            self._install(pending.seq, pending.first_chunk, arrays)
        self._pending = still

    def _install(self, seq: Sequence, first_chunk: int, arrays: list[np.ndarray]) -> None:
        pool, c = self.pool, self.chunk_blocks
        for i, kv in enumerate(arrays):
            if pool.num_free < c:
                break  # never evict running work to make room for a prefetch
            chunk = first_chunk + i
            hashes = seq.block_hashes[chunk * c : (chunk + 1) * c]
            blocks = [pool.allocate() for _ in hashes]
            self.transfer.write_blocks(0, blocks, kv)
            for block_id, prefix_hash in zip(blocks, hashes):
                pool.register(block_id, prefix_hash)
            pool.release(list(reversed(blocks)))  # cached and free, tail first, like any freed chain
            seq.num_stored_chunks = chunk + 1
            self.loaded_chunks += 1

    def save_completed(self, seqs: Iterable[Sequence]) -> dict[str, str]:
        failures = {}
        for seq in seqs:
            try:
                self._save(seq)
            except Exception:
                log.exception("saving the KV of %s failed", seq.request_id)
                failures[seq.request_id] = "internal error while saving the KV cache"
        return failures

    def _save(self, seq: Sequence) -> None:
        """Queue every chunk of `seq` whose blocks are all indexed and that is not stored yet."""
        c = self.chunk_blocks
        for chunk in range(seq.num_stored_chunks, len(seq.block_hashes) // c):
            hashes = seq.block_hashes[chunk * c : (chunk + 1) * c]
            blocks = [self.pool.lookup(h) for h in hashes]
            if None in blocks:
                return  # not computed yet (or evicted): later chunks cannot be complete either
            kv = self.transfer.read_blocks(0, blocks)
            traffic_class = seq.request.traffic_class or DEFAULT_TRAFFIC_CLASS
            self.store.save(
                hashes[-1],
                seq.prefix_root,
                kv,
                num_tokens=c * self.kv.block_size,
                traffic_class=traffic_class,
            )
            self.saved_chunks += 1
            seq.num_stored_chunks = chunk + 1

    def metrics(self) -> dict[str, float]:
        return {
            **self.store.metrics_snapshot(),
            "engine_chunks_loaded": self.loaded_chunks,
            "engine_chunks_saved": self.saved_chunks,
            "engine_pending_loads": len(self._pending),
        }

    def close(self, timeout_s: float) -> None:
        """Write every queued chunk (up to `timeout_s`), then stop; logs what reached the store."""
        before = self.store.metrics_snapshot()
        queued = int(before["write_queue_depth"])
        flushed = self.store.flush(timeout=timeout_s)
        self.store.close(timeout=0.0 if not flushed else 1.0)
        left = int(self.store.metrics_snapshot()["write_queue_depth"])
        log.info(
            "KV store at shutdown: %d of %d queued chunks written, %d dropped by the deadline "
            "(this run: %d chunks saved, %d dropped under memory pressure)",
            queued - left,
            queued,
            left,
            self.saved_chunks,
            int(before.get("write_drops", 0)),
        )
