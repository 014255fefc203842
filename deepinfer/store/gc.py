"""Garbage collection of the persistent store: expired objects first, then LRU down to a size cap.

Several machines may collect the same shared store at once: deletes are idempotent, and the
worst race (deleting an object just rewritten) costs one cache miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.store.backend import PersistentBackend


@dataclass(slots=True, frozen=True)
class GcReport:
    removed_expired: int
    removed_for_size: int
    removed_temporaries: int
    remaining_objects: int
    remaining_bytes: int


def collect_garbage(backend: PersistentBackend, now: float, size_cap_bytes: int | None) -> GcReport:
    """Raises StoreUnavailable if the backend fails mid-way; what was removed stays removed."""
    removed_temporaries = backend.sweep_temporaries()
    live = []
    removed_expired = 0
    for info in backend.scan():
        if info.expires_at <= now:
            backend.delete(info.key)
            removed_expired += 1
        else:
            live.append(info)
    total = sum(info.size for info in live)
    removed_for_size = 0
    if size_cap_bytes is not None and total > size_cap_bytes:
        live.sort(key=lambda info: info.last_access)
        for info in live:
            if total <= size_cap_bytes:
                break
            backend.delete(info.key)
            total -= info.size
            removed_for_size += 1
    return GcReport(
        removed_expired, removed_for_size, removed_temporaries, len(live) - removed_for_size, total
    )
