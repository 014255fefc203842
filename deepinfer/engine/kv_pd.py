"""Prefill/decode disaggregation as two KV connectors (kv_connector.py).

A prefill engine runs a handoff request (`kv_handoff` set: one output token, asked for by the
router) like any other; when it finishes, `PrefillHandoff` makes its prompt KV available:
- direct: the prompt's full blocks, found by prefix hash (freed but still indexed), get one more
  reference and a lease on the transfer listener (kv_transfer.py); they go back to the pool
  when the decoder has pulled them or the lease ends.
- store: the KV store connector (before this one in the chain) has queued the prompt's complete
  chunks for writing; the handoff is ready once they are written, so a decoder reading the
  same store finds them.
Either way a KVHandoff message says so, and the prefill server answers the router.

A decode engine given a request with a `kv_source` (`DecodeReceiver`) pulls the blocks beyond
its own prefix hits from the prefill engine while the sequence waits (others keep running),
writes them into free blocks and indexes them, so admission sees ordinary hits and computes
only the rest. A pull that fails (the prefiller died, the lease ended, it took longer than
kv_transfer_timeout) is recomputed or fails the request, per kv_transfer_failure. Large
transfers are installed a bounded number of blocks per step, so a 4k-token prompt landing never
stalls the running decodes for long. The direct path moves models with one cache group only; the
store path moves any (its chunks hold every group, kv_chunks.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from deepinfer.config import DisaggregationConfig
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_offload import BlockTransfer
from deepinfer.engine.kv_transfer import KVPuller, KVTransferServer
from deepinfer.engine.outputs import KVHandoff
from deepinfer.sequence import Sequence
from deepinfer.store import TieredKVStore

log = logging.getLogger(__name__)

INSTALL_BLOCKS_PER_STEP = 64  # 1024 tokens of 16: a few tens of ms of copying for a small model


def _single_group(kv: KVCacheManager, role: str) -> None:
    """The direct transfer moves the blocks of one cache group; a hybrid cache goes through the
    store (kv_transfer='store'), whose chunks hold every group."""
    if len(kv.groups) != 1:
        raise ValueError(
            f"role={role} with kv_transfer='direct': the direct KV handoff moves models with one "
            f"cache group; this model has {len(kv.groups)} "
            f"({', '.join(g.layout.group.kind for g in kv.groups)}): use kv_transfer='store'"
        )


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
    ) -> None:
        if config.kv_transfer == "direct":
            _single_group(kv, "prefill")
        self.kv = kv
        self.pool = kv.groups[0].pool
        self.config = config
        self.store = store
        self.server: KVTransferServer | None = None
        if config.kv_transfer == "direct":
            self.server = KVTransferServer(
                caches, config.kv_transfer_host, config.kv_transfer_port, config.kv_transfer_lease
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
        blocks: list[int] = []
        for prefix_hash in hashes:
            block_id = self.pool.lookup(prefix_hash)
            if block_id is None:
                break
            self.pool.touch(block_id)
            blocks.append(block_id)
        if not self.server.lease(transfer_id, hashes[: len(blocks)], blocks):
            self.pool.release(list(reversed(blocks)))
            self._ready.append(KVHandoff(transfer_id, error=f"the transfer id {transfer_id!r} is in use"))
            return
        self._ready.append(KVHandoff(transfer_id, len(blocks), len(blocks) * self.kv.block_size))

    def poll(self) -> dict[str, str]:
        if self.server is not None:
            for lease in self.server.reap():
                self.pool.release(list(reversed(lease.block_ids)))
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
                pd_transfers_sent=self.server.num_sent,
                pd_transfers_failed=self.server.num_failed,
                pd_leases_expired=self.server.num_expired,
                pd_pulls_unknown=self.server.num_unknown,
            )
        return metrics

    def close(self, timeout_s: float) -> None:
        if self.server is not None:
            self.server.close()
            for lease in self.server.reap():
                self.pool.release(list(reversed(lease.block_ids)))


@dataclass(slots=True)
class _Pull:
    seq: Sequence
    first_block: int  # the sequence's device hits when the pull started, in blocks
    future: Future[np.ndarray | None]
    kv: np.ndarray | None = None  # landed, being installed
    installed: int = 0  # blocks of `kv` installed so far


class DecodeReceiver:
    def __init__(self, kv: KVCacheManager, caches: BlockTransfer, config: DisaggregationConfig) -> None:
        _single_group(kv, "decode")
        self.kv = kv
        self.pool = kv.groups[0].pool
        self.caches = caches
        self.config = config
        self.puller = KVPuller(config.kv_transfer_timeout)
        self._pulls: list[_Pull] = []
        self.num_pulls = 0
        self.num_failed = 0
        self.blocks_received = 0

    def prefetch(self, seq: Sequence) -> None:
        """Pull the prompt blocks beyond the device hits (none wanted still releases the lease)."""
        source = seq.request.kv_source
        if source is None:
            return
        hits = self.kv.find_cached_prefix(seq).num_tokens // self.kv.block_size
        usable = (seq.num_tokens - 1) // self.kv.block_size
        wanted = seq.block_hashes[hits:usable]
        seq.num_pending += 1
        self.num_pulls += 1
        self._pulls.append(_Pull(seq, hits, self.puller.pull(source, wanted)))

    def poll(self) -> dict[str, str]:
        failures: dict[str, str] = {}
        budget = INSTALL_BLOCKS_PER_STEP
        still = []
        for pull in self._pulls:
            if pull.kv is None and not pull.future.done():
                still.append(pull)
                continue
            if pull.seq.is_finished:  # aborted while pulling
                pull.seq.num_pending -= 1
                continue
            if pull.kv is None:
                failure = self._landed(pull)
                if failure is not None:
                    pull.seq.num_pending -= 1
                    if self.config.kv_transfer_failure == "fail":
                        failures[pull.seq.request_id] = failure
                    continue
                if pull.kv is None:  # nothing to install: the decoder had it all
                    pull.seq.num_pending -= 1
                    continue
            try:
                budget -= self._install(pull, budget)
            except Exception as error:  # a KV of the wrong shape: another model answered
                log.exception("installing the KV pulled for %s failed", pull.seq.request_id)
                self.num_failed += 1
                pull.kv = None
                if self.config.kv_transfer_failure == "fail":
                    failures[pull.seq.request_id] = (
                        f"the prompt's KV from the prefill engine does not fit: {error}"
                    )
            if pull.kv is None:
                pull.seq.num_pending -= 1
            else:
                still.append(pull)
        self._pulls = still
        return failures

    def _landed(self, pull: _Pull) -> str | None:
        """Take a finished pull's result; the failure's message, if it failed."""
        try:
            pull.kv = pull.future.result()
        except Exception as error:
            self.num_failed += 1
            action = "failing the request" if self.config.kv_transfer_failure == "fail" else "recomputing"
            log.warning("KV transfer for %s failed (%s); %s", pull.seq.request_id, error, action)
            return f"the prompt's KV did not arrive from the prefill engine: {error}"
        return None

    def _install(self, pull: _Pull, budget: int) -> int:
        """Install up to `budget` blocks of a landed pull; returns how many. `pull.kv` becomes None
        when it is done (all installed, or no free blocks left: the rest is recomputed)."""
        assert pull.kv is not None
        total = pull.kv.shape[0]
        count = min(total - pull.installed, budget, self.pool.num_free)
        if count > 0:
            start = pull.installed
            blocks = [self.pool.allocate() for _ in range(count)]
            try:
                self.caches.write_blocks(0, blocks, pull.kv[start : start + count])
            except Exception:
                self.pool.release(blocks)
                raise
            first = pull.first_block + start
            self.kv.install_blocks(pull.seq, 0, list(range(first, first + count)), blocks)
            pull.installed += count
            self.blocks_received += count
        if pull.installed >= total or self.pool.num_free == 0:
            pull.kv = None
        return max(count, 0)

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
