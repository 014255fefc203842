"""What a persistent backend (shared directory, Redis) offers the tiered store.

Backends move opaque object bytes plus two timestamps -- last access and expiry deadline --
kept outside the object so that refreshing an expiry never rewrites a payload. Every
infrastructure failure surfaces as StoreUnavailable; absence and expiry are plain misses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

ObjectParts = Sequence[bytes | memoryview]


class StoreUnavailable(Exception):
    """The backend could not be reached or refused the operation (down, slow, read-only, full)."""


@dataclass(slots=True, frozen=True)
class ObjectInfo:
    key: bytes
    size: int
    last_access: float
    expires_at: float


class PersistentBackend(Protocol):
    name: str

    def put(self, key: bytes, parts: ObjectParts, expires_at: float, now: float) -> None:
        """Store atomically: readers see the old object, the new one, or none, never a mix."""
        ...

    def get(self, key: bytes, now: float) -> bytes | bytearray | None:
        """The object's bytes, or None when absent or expired at `now`."""
        ...

    def touch(self, key: bytes, expires_at: float, now: float) -> None:
        """Record an access: last access = now, new expiry deadline. Absent keys are ignored."""
        ...

    def count_present(self, keys: Sequence[bytes], now: float) -> int:
        """How many of `keys`, from the first, exist unexpired (stops at the first gap)."""
        ...

    def delete(self, key: bytes) -> None: ...

    def scan(self) -> Iterator[ObjectInfo]:
        """Every stored object, for garbage collection."""
        ...

    def sweep_temporaries(self) -> int:
        """Remove leftovers of interrupted writes; returns how many."""
        ...

    def ping(self) -> None:
        """Raise StoreUnavailable unless the backend answers."""
        ...

    def close(self) -> None: ...
