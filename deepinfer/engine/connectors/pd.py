"""Prefill/decode disaggregation as two KV connectors (kv_connector.py).

A prefill engine runs a handoff request (`kv_handoff` set: one output token, asked for by the
router) like any other; when it finishes, `PrefillHandoff` makes its prompt KV available:
- direct: the prompt's KV chunks (kv_chunks.py: per cache group what a prefix hit at the chunk's
  end needs) are copied off the device, found by prefix hash (freed but still indexed), into
  host memory and leased on the transfer listener (kv_transfer.py) until the decoder has pulled
  them or the lease ends. No device block stays pinned for a decoder.
- store: the KV store connector (before this one in the chain) has queued the prompt's complete
  chunks for writing; the handoff is ready once they are written, so a decoder reading the
  same store finds them.
Either way a KVHandoff message says so, and the prefill server answers the router.

A decode engine given a request with a `kv_source` (`DecodeReceiver`) pulls the chunks beyond
its own prefix hits from the prefill engine while the sequence waits (others keep running),
installs them into free blocks of every group and indexes them (`install_chunk`, the code that
installs store loads), so admission sees ordinary hits and computes only the rest. A pull that
fails (the prefiller died, the lease ended, it took longer than kv_transfer_timeout, the two
engines' chunk layouts differ) is recomputed or fails the request, per kv_transfer_failure.
Large transfers are installed about INSTALL_BLOCKS_PER_STEP blocks (whole chunks) per step, so a
4k-token prompt landing never stalls the running decodes for long.

What the direct path moves: the prompt's whole chunks of kv_chunk_blocks, then the tail shorter
than a chunk as one piece of the next chunk, cut at the last valid hit length (`ChunkLayout.pieces`:
a multiple of the lcm of the groups' block tokens, the lengths the device prefix cache hits on).
The decoder recomputes only what lies past that: the last prompt token always (it samples the
first output token itself), the partial block, and for a hybrid cache the tokens past the last
lcm boundary (fewer than 8 in the tiny V4). The store keeps whole chunks only (a piece is no
shared prefix's end), so there the decoder recomputes the whole tail shorter than a chunk.

One path for every model, no single-group fast path: for one full-attention group the lcm is a
block, so a piece is exactly its blocks and every block the earlier block-by-block transfer sent
is sent once, as before; the bytes on the wire are the same. What moved is the copy off the
device: from the listener's thread at pull time to the engine's thread at handoff, the copy the
store connector makes of every chunk it saves, small next to the prefill that produced the KV
(not measured on a GPU here). In exchange no device block is pinned while a decoder is awaited,
no thread but the engine's reads device memory, and a lease is plain host memory: a decoder that
never comes costs the prefiller RAM for the lease, never cache. Both engines need the same model,
cache layout and kv_chunk_blocks: the pull names the decoder's layout, another is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from deepinfer.config import DisaggregationConfig
from deepinfer.engine.connectors.chunks import BlockTransfer, ChunkLayout, install_chunk, read_chunk
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.outputs import KVHandoff
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.sequence import Sequence
from deepinfer.store import TieredKVStore
from deepinfer.transport.kv_transfer import KVPuller, KVTransferServer

log = logging.getLogger(__name__)

INSTALL_BLOCKS_PER_STEP = 64  # 1024 tokens of 16: a few tens of ms of copying for a small model


def handoff_blocks(seq: Sequence, block_size: int) -> int:
    """Full prompt blocks a decoder can use: all but the one holding the last prompt token's
    turn to be computed again (the decoder samples the first output token itself)."""
    return (seq.num_prompt_tokens - 1) // block_size


@dataclass(slots=True)
class _StoreHandoff:
    transfer_id: str
    keys: list[bytes]
    num_blocks: int
    deadline: float


class PrefillHandoff:
    def __init__(
        self,
        kv: KVCacheManager,
        caches: BlockTransfer,
        config: DisaggregationConfig,
        store: TieredKVStore | None,
        chunk_blocks: int,
    ) -> None:
        self.kv = kv
        self.caches = caches
        self.config = config
        self.store = store
        self.chunks = ChunkLayout(kv.groups, kv.block_size, chunk_blocks)
        self.server: KVTransferServer | None = None
        if config.kv_transfer == "direct":
            self.server = KVTransferServer(
                self.chunks.describe(),
                config.kv_transfer_host,
                config.kv_transfer_port,
                config.kv_transfer_lease,
                key=cluster_key_of(config.cluster_key_file),
            )
        elif store is None or store.backend is None:
            raise ValueError("kv_transfer='store' needs a shared --kv-store")
        self._writing: list[_StoreHandoff] = []
        self._ready: list[KVHandoff] = []
        self.num_handoffs = 0

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    def prefetch(self, seq: Sequence) -> None:
        return None

    def save_completed(self, seqs: Iterable[Sequence]) -> dict[str, str]:
        for seq in seqs:
            if seq.is_finished and seq.index == 0 and seq.request.kv_handoff is not None:
                self._hand_off(seq, seq.request.kv_handoff)
        return {}  # a handoff that cannot be made is reported to the prefill route, not failed here

    def _hand_off(self, seq: Sequence, transfer_id: str) -> None:
        self.num_handoffs += 1
        hashes = seq.block_hashes[: handoff_blocks(seq, self.kv.block_size)]
        if self.server is None:
            assert self.store is not None
            keys = self.store.chunk_keys(hashes)
            deadline = time.monotonic() + self.config.kv_transfer_lease
            self._writing.append(
                _StoreHandoff(transfer_id, keys, len(keys) * self.store.blocks_per_chunk, deadline)
            )
            return
        block_size = self.kv.block_size
        chunk_keys: list[bytes] = []
        payloads: list[np.ndarray] = []
        tokens = 0
        for chunk, end in self.chunks.pieces(len(hashes) * block_size):
            payload = read_chunk(self.kv, self.caches, seq, self.chunks.parts(chunk, end))
            if payload is None:  # evicted already: the decoder computes the rest
                break
            chunk_keys.append(hashes[end // block_size - 1])
            payloads.append(payload)
            tokens = end
        if not self.server.lease(transfer_id, chunk_keys, payloads):
            self._ready.append(KVHandoff(transfer_id, error=f"the transfer id {transfer_id!r} is in use"))
            return
        self._ready.append(KVHandoff(transfer_id, tokens // block_size, tokens))

    def poll(self) -> dict[str, str]:
        if self.server is not None:
            self.server.reap()  # pulled or expired: their chunks are dropped
        if self._writing:
            self._check_writes()
        return {}

    def _check_writes(self) -> None:
        assert self.store is not None
        now = time.monotonic()
        still = []
        for handoff in self._writing:
            if not self.store.writing(handoff.keys):
                tokens = handoff.num_blocks * self.kv.block_size
                self._ready.append(KVHandoff(handoff.transfer_id, handoff.num_blocks, tokens))
            elif handoff.deadline <= now:
                self._ready.append(
                    KVHandoff(
                        handoff.transfer_id, error="the KV store did not finish the writes within the lease"
                    )
                )
            else:
                still.append(handoff)
        self._writing = still

    def take_handoffs(self) -> list[KVHandoff]:
        ready, self._ready = self._ready, []
        return ready

    @property
    def busy(self) -> bool:
        return bool(self._writing) or (self.server is not None and self.server.num_leases > 0)

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {
            "pd_handoffs": self.num_handoffs,
            "pd_store_handoffs_writing": len(self._writing),
        }
        if self.server is not None:
            metrics.update(
                pd_leases=self.server.num_leases,
                pd_lease_bytes=self.server.num_bytes,
                pd_transfers_sent=self.server.num_sent,
                pd_transfers_failed=self.server.num_failed,
                pd_leases_expired=self.server.num_expired,
                pd_pulls_unknown=self.server.num_unknown,
                pd_peers_refused=self.server.num_refused,
            )
        return metrics

    def close(self, timeout_s: float) -> None:
        if self.server is not None:
            self.server.close()
            self.server.reap()


@dataclass(slots=True)
class _Pull:
    seq: Sequence
    pieces: list[tuple[int, int]]  # (chunk, end in tokens) asked for, in order
    future: Future[list[np.ndarray]]
    payloads: list[np.ndarray] | None = None  # landed, being installed
    installed: int = 0  # pieces of `payloads` installed so far


class DecodeReceiver:
    def __init__(
        self, kv: KVCacheManager, caches: BlockTransfer, config: DisaggregationConfig, chunk_blocks: int
    ) -> None:
        self.kv = kv
        self.caches = caches
        self.config = config
        self.chunks = ChunkLayout(kv.groups, kv.block_size, chunk_blocks)
        self.layout = self.chunks.describe()
        self.puller = KVPuller(config.kv_transfer_timeout, key=cluster_key_of(config.cluster_key_file))
        self._pulls: list[_Pull] = []
        self.num_pulls = 0
        self.num_failed = 0
        self.blocks_received = 0

    def prefetch(self, seq: Sequence) -> None:
        """Pull the prompt's chunks beyond the device hits, from the one holding the first token
        not hit on (none wanted still ends the lease)."""
        source = seq.request.kv_source
        if source is None:
            return
        hit = self.kv.find_cached_prefix(seq).num_tokens
        usable = (seq.num_tokens - 1) // self.kv.block_size * self.kv.block_size
        pieces = [(chunk, end) for chunk, end in self.chunks.pieces(usable) if end > hit]
        keys = [seq.block_hashes[end // self.kv.block_size - 1] for _, end in pieces]
        seq.num_pending += 1
        self.num_pulls += 1
        self._pulls.append(_Pull(seq, pieces, self.puller.pull(source, keys, self.layout)))

    def poll(self) -> dict[str, str]:
        failures: dict[str, str] = {}
        budget = INSTALL_BLOCKS_PER_STEP
        still = []
        for pull in self._pulls:
            if pull.payloads is None and not pull.future.done():
                still.append(pull)
                continue
            if pull.seq.is_finished:  # aborted while pulling
                pull.seq.num_pending -= 1
                continue
            if pull.payloads is None:
                failure = self._landed(pull)
                if failure is not None:
                    pull.seq.num_pending -= 1
                    if self.config.kv_transfer_failure == "fail":
                        failures[pull.seq.request_id] = failure
                    continue
                if pull.payloads is None:  # nothing to install: the decoder had it all
                    pull.seq.num_pending -= 1
                    continue
            try:
                budget -= self._install(pull, budget)
            except Exception as error:  # a KV of the wrong size: another model answered
                log.exception("installing the KV pulled for %s failed", pull.seq.request_id)
                self.num_failed += 1
                pull.payloads = None
                if self.config.kv_transfer_failure == "fail":
                    failures[pull.seq.request_id] = (
                        f"the prompt's KV from the prefill engine does not fit: {error}"
                    )
            if pull.payloads is None:
                pull.seq.num_pending -= 1
            else:
                still.append(pull)
        self._pulls = still
        return failures

    def _landed(self, pull: _Pull) -> str | None:
        """Take a finished pull's result; the failure's message, if it failed."""
        try:
            payloads = pull.future.result()
        except Exception as error:
            self.num_failed += 1
            action = "failing the request" if self.config.kv_transfer_failure == "fail" else "recomputing"
            log.warning("KV transfer for %s failed (%s); %s", pull.seq.request_id, error, action)
            # The client's error names no address (the transfer listener's is internal): the
            # log line above has the details.
            return "the prompt's KV did not arrive from the prefill engine (the decode engine's log says why)"
        pull.payloads = payloads or None
        return None

    def _install(self, pull: _Pull, budget: int) -> int:
        """Install whole chunks of a landed pull while `budget` blocks last; returns how many
        blocks it wrote. `pull.payloads` becomes None when it is done (all installed, or no free
        blocks left: the rest is recomputed)."""
        written = 0
        while pull.payloads is not None and written < budget:
            chunk, end = pull.pieces[pull.installed]
            parts = self.chunks.parts(chunk, end)
            count = install_chunk(self.kv, self.caches, pull.seq, parts, pull.payloads[pull.installed])
            if count is None:
                pull.payloads = None
                break
            written += count
            self.blocks_received += count
            pull.installed += 1
            if pull.installed == len(pull.payloads):
                pull.payloads = None
        return written

    def save_completed(self, seqs: Iterable[Sequence]) -> dict[str, str]:
        return {}

    def take_handoffs(self) -> list[KVHandoff]:
        return []

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def metrics(self) -> dict[str, float]:
        return {
            "pd_pulls": self.num_pulls,
            "pd_pulls_failed": self.num_failed,
            "pd_pulls_in_flight": len(self._pulls),
            "pd_blocks_received": self.blocks_received,
        }

    def close(self, timeout_s: float) -> None:
        self.puller.close()
