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

With an event log, what it saves is reported as Stored events of the host tier (CPU) and the
shared store (STORE), and what the host tier drops as Removed ones: a router credits a chunk in
the shared store to every engine that reads that store.

Chunks hold every cache group of the model (kv_chunks.py says what is kept per chunk and why:
all of a full or compressed group's blocks, a sliding group's last window), so DeepSeek-V4's
hybrid cache goes to the host tier and the store like a single-group model's. Chunks live in a
namespace that folds in the cache-group layout and the chunk format: a chunk of other groups
never matches.

One KVConnector implementation (kv_connector.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.connectors.chunks import BlockTransfer, ChunkLayout, install_chunk, read_chunk
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.outputs import KVHandoff
from deepinfer.sequence import Sequence
from deepinfer.store import DEFAULT_TRAFFIC_CLASS, TieredKVStore
from deepinfer.transport.kv_event_log import HOST, STORE, KVEventLog

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingLoad:
    seq: Sequence
    first_chunk: int
    future: Future[list[np.ndarray]]
    arrived: list[np.ndarray]  # the chunks delivered so far (the loading thread appends)
    installed: int = 0  # how many of them are in device blocks
    stopped: bool = False  # a chunk did not fit: none after it is installed


class TierEvents:
    """KV events of the tiers beyond the device: chunks saved (host and store) and chunks the
    host tier dropped. Host evictions arrive on whichever thread touched the tier; the map of
    chunk keys to their blocks' hashes is only ever changed by single dict operations."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self._host_chunks: dict[bytes, list[bytes]] = {}

    def saved(
        self, seq: Sequence, first_block: int, num_blocks: int, block_size: int, store: TieredKVStore
    ) -> None:
        hashes = seq.block_hashes[first_block : first_block + num_blocks]
        parent = seq.block_hashes[first_block - 1] if first_block else None
        tokens = seq.token_ids[first_block * block_size : (first_block + num_blocks) * block_size]
        if store.host is not None:
            self._host_chunks[hashes[-1]] = hashes
            self.log.stored(hashes, parent, tokens, block_size, HOST)
        if store.backend is not None:
            self.log.stored(hashes, parent, tokens, block_size, STORE)

    def host_evicted(self, key: bytes) -> None:
        hashes = self._host_chunks.pop(key, None)
        if hashes is not None:
            self.log.removed(hashes, HOST)


class KVOffloader:
    def __init__(
        self,
        store: TieredKVStore,
        kv: KVCacheManager,
        transfer: BlockTransfer,
        events: TierEvents | None = None,
    ) -> None:
        self.store = store
        self.kv = kv
        self.transfer = transfer
        self.events = events
        self.chunk_blocks = store.blocks_per_chunk
        self.chunks = ChunkLayout(kv.groups, kv.block_size, self.chunk_blocks)
        self._namespaces: dict[bytes, bytes] = {}
        self._pending: list[_PendingLoad] = []
        self.loaded_chunks = 0
        self.saved_chunks = 0

    def _namespace(self, seq: Sequence) -> bytes:
        namespace = self._namespaces.get(seq.prefix_root)
        if namespace is None:
            namespace = self._namespaces[seq.prefix_root] = self.chunks.store_namespace(seq.prefix_root)
        return namespace

    def prefetch(self, seq: Sequence) -> None:
        """Start loading the stored chunks beyond the device hits; the sequence waits for them."""
        hits = self.kv.find_cached_prefix(seq).num_tokens // self.kv.block_size
        usable = (seq.num_tokens - 1) // self.kv.block_size  # the last token is always computed
        keys = self.store.chunk_keys(seq.block_hashes[:usable])
        first = hits // self.chunk_blocks
        seq.num_stored_chunks = first
        if first >= len(keys):
            return
        namespace = self._namespace(seq)
        found = self.store.lookup(keys[first:], namespace)
        if found == 0:
            return
        seq.num_pending += 1
        arrived: list[np.ndarray] = []
        future = self.store.load(keys[first : first + found], namespace, arrived)
        self._pending.append(_PendingLoad(seq, first, future, arrived))

    def poll(self) -> dict[str, str]:
        """Install the chunks delivered since the last poll into device blocks while later ones
        are still read (a slow store's reads then overlap the copies into the cache); release
        each sequence whose load has finished (a load that failed is a miss: the sequence
        recomputes, it never fails)."""
        still: list[_PendingLoad] = []
        for pending in self._pending:
            # Done is read before the arrivals: a finished load has appended all of its chunks.
            done = pending.future.done()
            if not pending.seq.is_finished:  # else aborted while loading: nothing to install
                try:
                    self._install(pending)
                except Exception:  # the store degrades to misses; the engine recomputes
                    log.exception("installing KV from the store failed; recomputing")
                    pending.stopped = True
            if not done:
                still.append(pending)
                continue
            pending.seq.num_pending -= 1
            failure = pending.future.exception() if not pending.future.cancelled() else None
            if failure is not None:
                log.error("loading KV from the store failed; recomputing", exc_info=failure)
        self._pending = still
        return {}

    def _install(self, pending: _PendingLoad) -> None:
        """Write each delivered chunk not yet installed into free blocks of every group and
        index them; stops for good at the first chunk that does not fit (never evicting running
        work for a prefetch) or does not have the layout's size."""
        seq = pending.seq
        while not pending.stopped and pending.installed < len(pending.arrived):
            chunk = pending.first_chunk + pending.installed
            try:
                written = install_chunk(
                    self.kv, self.transfer, seq, self.chunks.parts(chunk), pending.arrived[pending.installed]
                )
            except ValueError as error:
                log.warning("a stored KV chunk does not fit: %s; recomputing", error)
                written = None
            if written is None:
                pending.stopped = True
                return
            pending.installed += 1
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
        hashes = seq.block_hashes
        for chunk in range(seq.num_stored_chunks, len(hashes) // c):
            payload = read_chunk(self.kv, self.transfer, seq, self.chunks.parts(chunk))
            if payload is None:
                return  # not computed yet (or evicted): later chunks cannot be complete either
            traffic_class = seq.request.traffic_class or DEFAULT_TRAFFIC_CLASS
            accepted = self.store.save(
                hashes[(chunk + 1) * c - 1],
                self._namespace(seq),
                payload,
                num_tokens=c * self.kv.block_size,
                traffic_class=traffic_class,
            )
            if accepted and self.events is not None:
                self.events.saved(seq, chunk * c, c, self.kv.block_size, self.store)
            self.saved_chunks += 1
            seq.num_stored_chunks = chunk + 1

    def take_handoffs(self) -> list[KVHandoff]:
        return []

    @property
    def busy(self) -> bool:
        return bool(self._pending)

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
