"""Write-behind: a bounded queue drained by one worker thread.

The engine thread only ever enqueues. When the store is slow and the queue is full, the new
write is dropped and counted -- a lost write is a future cache miss, a stalled engine is lost
throughput for every running request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from deepinfer.store.metrics import StoreMetrics

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteJob:
    key: bytes
    namespace: bytes
    array: np.ndarray
    num_tokens: int
    traffic_class: str


class WriteBehind:
    def __init__(
        self,
        handler: Callable[[WriteJob], None],
        capacity: int,
        metrics: StoreMetrics,
        max_bytes: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"write queue capacity must be >= 1, got {capacity}")
        self._handler = handler
        # Queued jobs hold their payloads in host memory, so the queue is bounded in bytes too.
        self._max_bytes = max_bytes
        self._pending_bytes = 0
        self._metrics = metrics
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=capacity)
        self._pending_keys: set[bytes] = set()
        self._unfinished = 0
        self._idle = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs accepted and not yet finished (queued plus the one being written)."""
        return self._unfinished

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def submit(self, job: WriteJob) -> bool:
        """Enqueue without blocking; False when dropped (queue full or closed)."""
        with self._idle:
            if self._closed:
                self._metrics.add("write_drops")
                return False
            if job.key in self._pending_keys:
                return True  # the same chunk is already on its way
            nbytes = job.array.nbytes
            if (
                self._max_bytes is not None
                and self._unfinished
                and self._pending_bytes + nbytes > self._max_bytes
            ):
                self._metrics.add("write_drops")
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self._metrics.add("write_drops")
                return False
            self._pending_keys.add(job.key)
            self._pending_bytes += nbytes
            self._unfinished += 1
            return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._handler(job)
            except Exception:
                logger.exception("kv store write of %s failed unexpectedly", job.key.hex())
                self._metrics.add("errors")
            finally:
                with self._idle:
                    self._pending_keys.discard(job.key)
                    self._pending_bytes -= job.array.nbytes
                    self._unfinished -= 1
                    self._idle.notify_all()

    def pending(self, keys: Iterable[bytes]) -> bool:
        """Whether any of `keys` is accepted and not finished yet."""
        with self._idle:
            return any(key in self._pending_keys for key in keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted write is finished; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._unfinished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new writes, finish the queued ones (up to `timeout`), stop the worker."""
        with self._idle:
            self._closed = True
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=max(timeout, 0.1))
        except queue.Full:
            logger.warning("kv store writer still busy at close; abandoning %d queued writes", self.depth)
            return
        self._thread.join(timeout)
