"""What the router believes each replica's prefix caches hold, from the KV events they publish.

Per replica, the block hashes in its device pool and its host tier; per shared store (by its
identity, as the replicas report it), the block hashes written there, credited to every replica
reading that store. A request's prompt, hashed the engines' way (same fingerprint root, cache
salt and block size), is matched block by block from the start: the chain continues while some
tier holds the next block (the engine loads host and store chunks beyond its device hits), and
each block earns its tier's credit. Store objects expire and are collected without events, so a
store entry is an estimate until an engine misses it (and recomputes: never wrong, only slower).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from deepinfer.transport.kv_event_log import DEVICE, HOST, STORE
from deepinfer.transport.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent


@dataclass(frozen=True, slots=True)
class TierCredits:
    device: float = 1.0
    host: float = 0.8
    store: float = 0.6


@dataclass(slots=True)
class _ReplicaCache:
    device: set[bytes] = field(default_factory=set)
    host: set[bytes] = field(default_factory=set)
    store: str | None = None  # identity of the shared store it reads


@dataclass(slots=True)
class PrefixMatch:
    credit: float  # blocks, weighted by tier
    num_blocks: int  # blocks matched in any tier
    device_blocks: int
    # the credit of the matched blocks past those the prompt shares with other conversations
    # (branches.py); None: all of it
    own: float | None = None

    @property
    def own_credit(self) -> float:
        return self.credit if self.own is None else self.own

    def ratio(self, total_blocks: int) -> float:
        return self.credit / total_blocks if total_blocks else 0.0


class PrefixIndex:
    def __init__(self, credits: TierCredits | None = None) -> None:
        self.credits = credits or TierCredits()
        self._replicas: dict[str, _ReplicaCache] = {}
        self._stores: dict[str, set[bytes]] = {}
        self.num_events = 0

    def add_replica(self, name: str, store: str | None) -> None:
        cache = self._replicas.setdefault(name, _ReplicaCache())
        cache.store = store
        if store is not None:
            self._stores.setdefault(store, set())

    def forget(self, name: str) -> None:
        """Drop what a replica's own tiers hold (it restarted, or events were lost)."""
        cache = self._replicas.get(name)
        if cache is not None:
            cache.device.clear()
            cache.host.clear()

    def apply(self, name: str, events: Iterable[WireEvent]) -> None:
        cache = self._replicas.get(name)
        if cache is None:
            return
        for event in events:
            self.num_events += 1
            if isinstance(event, BlockStored):
                self._tier(cache, event.medium).update(_as_bytes(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.medium == STORE:
                    continue  # another engine may still read it from the store
                self._tier(cache, event.medium).difference_update(_as_bytes(h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                cache.device.clear()

    def _tier(self, cache: _ReplicaCache, medium: str | None) -> set[bytes]:
        if medium == HOST:
            return cache.host
        if medium == STORE:
            if cache.store is None:
                return set()  # a store this replica did not announce: nobody can credit it
            return self._stores.setdefault(cache.store, set())
        return cache.device  # DEVICE, or None from a publisher that names no tier

    def match(self, name: str, block_hashes: list[bytes], shared_blocks: int = 0) -> PrefixMatch:
        """The chain's match on replica `name`; the first `shared_blocks` blocks (shared with other
        conversations) earn no own credit."""
        cache = self._replicas.get(name)
        if cache is None:
            return PrefixMatch(0.0, 0, 0, 0.0)
        store = self._stores.get(cache.store) if cache.store is not None else None
        credit = own = 0.0
        device_blocks = 0
        matched = 0
        for prefix_hash in block_hashes:
            if prefix_hash in cache.device:
                earned = self.credits.device
                if matched == device_blocks:
                    device_blocks += 1
            elif prefix_hash in cache.host:
                earned = self.credits.host
            elif store is not None and prefix_hash in store:
                earned = self.credits.store
            else:
                break
            credit += earned
            own += earned if matched >= shared_blocks else 0.0
            matched += 1
        return PrefixMatch(credit, matched, device_blocks, own)

    def size(self, name: str) -> dict[str, int]:
        cache = self._replicas.get(name)
        if cache is None:
            return {}
        sizes = {DEVICE: len(cache.device), HOST: len(cache.host)}
        if cache.store is not None:
            sizes[STORE] = len(self._stores.get(cache.store, ()))
        return sizes


def _as_bytes(block_hash: bytes | int) -> bytes:
    """Our engines send 32-byte hashes; a vLLM publisher may send ints (kept distinct, never matched)."""
    return block_hash if isinstance(block_hash, bytes) else block_hash.to_bytes(32, "big", signed=True)
