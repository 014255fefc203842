"""The host-memory tier: an LRU of chunk arrays bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from deepinfer.store.clock import Clock
from deepinfer.store.metrics import StoreMetrics


@dataclass(slots=True)
class _Entry:
    array: np.ndarray
    namespace: bytes
    ttl_s: float
    expires_at: float


class HostTier:
    """Holds arrays by reference (read-only views): callers hand over arrays they no longer mutate.
    `on_evict(key)` is told of every entry dropped for room or expiry (under the tier's lock:
    it must be quick and must not call back into the tier)."""

    def __init__(
        self,
        capacity_bytes: int,
        clock: Clock,
        metrics: StoreMetrics,
        on_evict: Callable[[bytes], None] | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        self.metrics = metrics
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, namespace: bytes, array: np.ndarray, ttl_s: float) -> bool:
        """Insert or replace, evicting least recently used entries; False if it can never fit."""
        expires_at = self.clock.now() + ttl_s
        if array.nbytes > self.capacity_bytes:
            return False
        view = array.view()
        view.flags.writeable = False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= old.array.nbytes
            while self._entries and self.used_bytes + array.nbytes > self.capacity_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                self.used_bytes -= evicted.array.nbytes
                self.metrics.add("host_evictions")
                if self._on_evict is not None:
                    self._on_evict(evicted_key)
            self._entries[key] = _Entry(view, namespace, ttl_s, expires_at)
            self.used_bytes += array.nbytes
        return True

    def _live(self, key: bytes, namespace: bytes, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.namespace != namespace:
            return None
        if entry.expires_at <= now:
            del self._entries[key]
            self.used_bytes -= entry.array.nbytes
            if self._on_evict is not None:
                self._on_evict(key)
            return None
        return entry

    def get(self, key: bytes, namespace: bytes) -> np.ndarray | None:
        """The array, marking it most recently used and refreshing its expiry."""
        now = self.clock.now()
        with self._lock:
            entry = self._live(key, namespace, now)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            entry.expires_at = now + entry.ttl_s
            return entry.array

    def remove_expired(self) -> int:
        now = self.clock.now()
        with self._lock:
            expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
            for key in expired:
                self.used_bytes -= self._entries.pop(key).array.nbytes
                if self._on_evict is not None:
                    self._on_evict(key)
        return len(expired)

    def contains(self, key: bytes, namespace: bytes) -> bool:
        with self._lock:
            return self._live(key, namespace, self.clock.now()) is not None
