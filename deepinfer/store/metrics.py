"""Plain counters for the KV store; the server exports them to Prometheus."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class StoreMetrics:
    lookups: int = 0
    host_hits: int = 0  # chunks served from host memory
    store_hits: int = 0  # chunks served from the persistent store
    misses: int = 0  # chunks asked for by a load and not delivered
    bytes_read: int = 0
    bytes_written: int = 0
    loads: int = 0
    load_seconds_total: float = 0.0
    load_seconds_max: float = 0.0
    writes: int = 0
    writes_skipped_existing: int = 0
    write_drops: int = 0  # queue full, breaker open, or store closed
    errors: int = 0  # store failures: unreachable, slow, refused, garbage
    lookup_timeouts: int = 0
    corrupt_objects: int = 0  # truncated or failed the checksum; deleted when seen
    foreign_objects: int = 0  # another format version, key or namespace
    forged_objects: int = 0  # failed the cluster key's MAC / AES-GCM tag, or had none; deleted
    temporaries_removed: int = 0  # leftovers of interrupted writes removed at start or by GC
    host_evictions: int = 0
    gc_runs: int = 0
    gc_removed_expired: int = 0
    gc_removed_for_size: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int | float = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self.loads += 1
            self.load_seconds_total += seconds
            self.load_seconds_max = max(self.load_seconds_max, seconds)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
