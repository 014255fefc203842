"""KV events: what the prefix caches of an engine gained and lost, for routers outside it.

The device pool of the first cache group, the host tier and the shared store each report the
blocks they index and drop; the engine loop drains the log after every step and publishes it
(transport/kv_events.py, in vLLM's wire format). Torch-free; appends may come from the store's
threads as well as the engine's, so the log is a deque (atomic appends and pops).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Tier names follow vLLM's `medium` values so its consumers read them: GPU is the engine's own KV
# pool (whatever the device), CPU the host-memory tier; STORE is the shared persistent store.
DEVICE = "GPU"
HOST = "CPU"
STORE = "STORE"
TIERS = (DEVICE, HOST, STORE)


@dataclass(slots=True)
class Stored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the block before the first one; None at a sequence's start
    token_ids: list[int]
    block_size: int
    medium: str


@dataclass(slots=True)
class Removed:
    block_hashes: list[bytes]
    medium: str


@dataclass(slots=True)
class Cleared:
    pass


KVEvent = Stored | Removed | Cleared


class KVEventLog:
    def __init__(self) -> None:
        self._events: deque[KVEvent] = deque()

    def stored(
        self,
        block_hashes: list[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str = DEVICE,
    ) -> None:
        if block_hashes:
            self._events.append(Stored(block_hashes, parent, list(token_ids), block_size, medium))

    def removed(self, block_hashes: list[bytes], medium: str = DEVICE) -> None:
        if block_hashes:
            self._events.append(Removed(block_hashes, medium))

    def cleared(self) -> None:
        self._events.append(Cleared())

    def drain(self) -> list[KVEvent]:
        """Every event logged so far, oldest first; the log is empty afterwards."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def __len__(self) -> int:
        return len(self._events)
