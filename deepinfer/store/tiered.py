"""The tier stack behind KVStore: host memory first, then the persistent shared store."""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from deepinfer.store.api import chunk_keys
from deepinfer.store.backend import PersistentBackend, StoreUnavailable
from deepinfer.store.breaker import CircuitBreaker
from deepinfer.store.clock import SYSTEM_CLOCK, Clock
from deepinfer.store.gc import GcReport, collect_garbage
from deepinfer.store.host import HostTier
from deepinfer.store.metrics import StoreMetrics
from deepinfer.store.objects import (
    UNSEALED,
    CorruptObject,
    ForeignObject,
    ForgedObject,
    as_payload_array,
    decode_object,
    encode_object,
)
from deepinfer.store.retention import RetentionPolicy
from deepinfer.store.seal import ChunkSeal
from deepinfer.store.write_behind import WriteBehind, WriteJob

logger = logging.getLogger(__name__)

READ_AHEAD = 2  # chunks of one load read at once (threads of the store's reader pool)


class TieredKVStore:
    def __init__(
        self,
        *,
        retention: RetentionPolicy | None = None,
        blocks_per_chunk: int = 16,
        host_cache_bytes: int = 0,
        backend: PersistentBackend | None = None,
        clock: Clock = SYSTEM_CLOCK,
        failure_threshold: int = 5,
        probe_interval_s: float = 5.0,
        write_queue_size: int = 64,
        write_queue_bytes: int | None = 1 << 30,
        size_cap_bytes: int | None = None,
        load_threads: int = 2,
        lookup_timeout_s: float = 0.1,
        gc_interval_s: float | None = None,
        on_host_evict: Callable[[bytes], None] | None = None,
        seal: ChunkSeal = UNSEALED,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if size_cap_bytes is not None and size_cap_bytes < 0:
            raise ValueError(f"size_cap_bytes must be >= 0, got {size_cap_bytes}")
        self.retention = retention or RetentionPolicy()
        self._blocks_per_chunk = blocks_per_chunk
        self.clock = clock
        self.metrics = StoreMetrics()
        self.host = (
            HostTier(host_cache_bytes, clock, self.metrics, on_host_evict) if host_cache_bytes > 0 else None
        )
        self.backend = backend
        self.seal = seal
        # Separate breakers: a read-only or full store fails every write, yet reads must go on.
        self.read_breaker = CircuitBreaker(
            failure_threshold=failure_threshold,
            probe_interval_s=probe_interval_s,
            clock=clock,
            name="kv-store reads",
        )
        self.write_breaker = CircuitBreaker(
            failure_threshold=failure_threshold,
            probe_interval_s=probe_interval_s,
            clock=clock,
            name="kv-store writes",
        )
        self.size_cap_bytes = size_cap_bytes
        self.lookup_timeout_s = lookup_timeout_s
        self._writer = (
            WriteBehind(self._write, write_queue_size, self.metrics, write_queue_bytes) if backend else None
        )
        self._loads = ThreadPoolExecutor(load_threads, thread_name_prefix="kv-store-load")
        self._reads = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="kv-store-read")
        # Lookups get their own threads so a backlog of loads never delays a lookup's answer.
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="kv-store-lookup")
        self._stop = threading.Event()
        self._gc_thread: threading.Thread | None = None
        if backend is not None:
            # Leftovers of writers killed mid-write (kill -9, a crash) go at start, off the
            # engine's path: on a large shared store the scan takes a while.
            threading.Thread(target=self._sweep, name="kv-store-sweep", daemon=True).start()
        if backend is not None and gc_interval_s is not None:
            self._gc_thread = threading.Thread(
                target=self._gc_loop, args=(gc_interval_s,), name="kv-store-gc", daemon=True
            )
            self._gc_thread.start()

    @property
    def blocks_per_chunk(self) -> int:
        return self._blocks_per_chunk

    def chunk_keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return chunk_keys(block_hashes, self._blocks_per_chunk)

    # -- lookup ---------------------------------------------------------------------------

    def _in_host(self, key: bytes, namespace: bytes) -> bool:
        return self.host is not None and self.host.contains(key, namespace)

    def _count_in_store(self, keys: Sequence[bytes]) -> int:
        if self.backend is None or not keys or not self.read_breaker.allow():
            return 0
        future = self._lookups.submit(self.backend.count_present, keys, self.clock.now())
        try:
            count = future.result(timeout=self.lookup_timeout_s)
        except FutureTimeout:
            future.cancel()  # if it has not started, it never will; a started one finishes unheard
            self.metrics.add("lookup_timeouts")
            self._failed(self.read_breaker, f"lookup slower than {self.lookup_timeout_s}s")
            return 0
        except StoreUnavailable as exc:
            self._failed(self.read_breaker, exc)
            return 0
        except Exception as exc:
            logger.exception("kv store lookup failed unexpectedly")
            self._failed(self.read_breaker, exc)
            return 0
        self.read_breaker.record_success()
        return count

    def lookup(self, keys: Sequence[bytes], namespace: bytes) -> int:
        self.metrics.add("lookups")
        found = 0
        while found < len(keys):
            if self._in_host(keys[found], namespace):
                found += 1
                continue
            in_store = self._count_in_store(keys[found:])
            found += in_store
            if in_store == 0 or (found < len(keys) and not self._in_host(keys[found], namespace)):
                break
        return found

    # -- load -----------------------------------------------------------------------------

    def load(
        self, keys: Sequence[bytes], namespace: bytes, arrived: list[np.ndarray] | None = None
    ) -> Future[list[np.ndarray]]:
        started = time.perf_counter()
        arrays: list[np.ndarray] = arrived if arrived is not None else []
        for key in keys:
            array = self.host.get(key, namespace) if self.host is not None else None
            if array is None:
                break
            arrays.append(array)
        self.metrics.add("host_hits", len(arrays))
        if len(arrays) == len(keys) or self.backend is None:
            done: Future[list[np.ndarray]] = Future()
            done.set_result(self._finish_load(keys, arrays, started))
            return done
        return self._loads.submit(self._load_rest, list(keys), namespace, arrays, started)

    def _load_rest(
        self, keys: list[bytes], namespace: bytes, arrays: list[np.ndarray], started: float
    ) -> list[np.ndarray]:
        # READ_AHEAD chunks are read at once: one chunk's file read and checksum (both without
        # the GIL) overlap the next one's, and a chunk that turns out missing wastes at most
        # READ_AHEAD - 1 reads. Delivered in order, up to the first chunk not delivered.
        rest = keys[len(arrays) :]
        window: deque[Future[tuple[np.ndarray | None, str]]] = deque()
        submitted = 0
        try:
            while window or submitted < len(rest):
                while submitted < len(rest) and len(window) < READ_AHEAD and not self._stop.is_set():
                    window.append(self._reads.submit(self._read_chunk, rest[submitted], namespace))
                    submitted += 1
                if not window:
                    break  # closing: deliver what is loaded
                array, source = window.popleft().result()
                if array is None:
                    break
                self.metrics.add(source)
                arrays.append(array)
        except Exception:
            # A bug must not strand a waiting request: deliver what is loaded, the rest is recomputed.
            if not self._stop.is_set():  # else closing: a read refused or cancelled by the shutdown
                logger.exception("kv store load failed unexpectedly")
                self.metrics.add("errors")
        finally:
            for future in window:
                future.cancel()  # one already running finishes unheard
        return self._finish_load(keys, arrays, started)

    def _read_chunk(self, key: bytes, namespace: bytes) -> tuple[np.ndarray | None, str]:
        """One chunk from the host tier, else the store; with the metric its delivery counts in."""
        array = self.host.get(key, namespace) if self.host is not None else None
        if array is not None:
            return array, "host_hits"
        return self._read_from_store(key, namespace), "store_hits"

    def _finish_load(
        self, keys: Sequence[bytes], arrays: list[np.ndarray], started: float
    ) -> list[np.ndarray]:
        self.metrics.add("misses", len(keys) - len(arrays))
        self.metrics.observe_load(time.perf_counter() - started)
        return arrays

    def _read_from_store(self, key: bytes, namespace: bytes) -> np.ndarray | None:
        assert self.backend is not None
        if not self.read_breaker.allow():
            return None
        now = self.clock.now()
        try:
            data = self.backend.get(key, now)
        except StoreUnavailable as exc:
            self._failed(self.read_breaker, exc)
            return None
        if data is None:
            self.read_breaker.record_success()
            return None
        self.metrics.add("bytes_read", len(data))
        try:
            obj = decode_object(data, key, namespace, self.seal)
        except ForgedObject as exc:
            # Not the store's fault, and not damage: someone who can write to the store without
            # holding the cluster key (or an engine with another key). Worth an operator's eye;
            # deleted so that the next writer of this chunk replaces it.
            self.metrics.add("forged_objects")
            logger.warning("kv store: chunk %s failed authentication (%s); treated as a miss", key.hex(), exc)
            self.read_breaker.record_success()
            self._delete_quietly(key)
            return None
        except CorruptObject as exc:
            # Garbage from the store counts against it like an error; the object is useless, so
            # delete it and let the next writer of this chunk replace it.
            self.metrics.add("corrupt_objects")
            self._failed(self.read_breaker, f"corrupt object {key.hex()}: {exc}")
            self._delete_quietly(key)
            return None
        except ForeignObject as exc:
            logger.debug("kv store: %s is not ours: %s", key.hex(), exc)
            self.metrics.add("foreign_objects")
            self.read_breaker.record_success()
            return None
        self.read_breaker.record_success()
        ttl = self.retention.ttls.get(obj.header.traffic_class)
        if ttl is not None:
            self._refresh(key, now + ttl, now)
        if self.host is not None:
            # A class this process does not know gets the shortest configured retention here.
            self.host.put(key, namespace, obj.array, ttl or min(self.retention.ttls.values()))
        return obj.array

    def _refresh(self, key: bytes, expires_at: float, now: float) -> None:
        # A refresh is a write: a read-only store fails it, is counted, and reads go on.
        assert self.backend is not None
        try:
            self.backend.touch(key, expires_at, now)
        except StoreUnavailable as exc:
            logger.debug("kv store: refresh failed: %s", exc)
            self.metrics.add("errors")

    def _delete_quietly(self, key: bytes) -> None:
        assert self.backend is not None
        try:
            self.backend.delete(key)
        except StoreUnavailable as exc:
            logger.debug("kv store: could not delete corrupt %s: %s", key.hex(), exc)

    # -- save -----------------------------------------------------------------------------

    def save(
        self,
        key: bytes,
        namespace: bytes,
        payload: np.ndarray | bytes,
        *,
        num_tokens: int,
        traffic_class: str,
    ) -> bool:
        if not isinstance(key, bytes) or not key:
            raise TypeError("key must be non-empty bytes (the prefix hash of the chunk's last block)")
        if not isinstance(namespace, bytes):
            raise TypeError(f"namespace must be bytes, got {type(namespace).__name__}")
        try:
            num_tokens = operator.index(num_tokens)
        except TypeError:
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}") from None
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        ttl = self.retention.ttl(traffic_class)
        array = as_payload_array(payload)
        if self.host is not None:
            self.host.put(key, namespace, array, ttl)
        if self._writer is None:
            return True
        if self.write_breaker.refusing():
            self.metrics.add("write_drops")
            return False
        return self._writer.submit(WriteJob(key, namespace, array, num_tokens, traffic_class))

    def _write(self, job: WriteJob) -> None:
        assert self.backend is not None
        if not self.write_breaker.allow():
            self.metrics.add("write_drops")
            return
        now = self.clock.now()
        expires_at = now + self.retention.ttl(job.traffic_class)
        try:
            # Another request or machine may have stored this chunk already: rewriting the same
            # prefix costs bandwidth for nothing, so only extend its life.
            if self.backend.count_present([job.key], now):
                self.backend.touch(job.key, expires_at, now)
                self.metrics.add("writes_skipped_existing")
            else:
                parts = encode_object(
                    job.key, job.namespace, job.traffic_class, job.num_tokens, job.array, self.seal
                )
                self.backend.put(job.key, parts, expires_at, now)
                self.metrics.add("writes")
                self.metrics.add("bytes_written", sum(memoryview(part).nbytes for part in parts))
        except StoreUnavailable as exc:
            self._failed(self.write_breaker, exc)
            return
        self.write_breaker.record_success()

    # -- housekeeping ---------------------------------------------------------------------

    def _failed(self, breaker: CircuitBreaker, error: object) -> None:
        logger.debug("kv store error: %s", error)
        self.metrics.add("errors")
        breaker.record_failure(error)

    def gc(self) -> GcReport | None:
        """Drop expired objects, then least recently used ones beyond the size cap; None if the
        store could not be collected now."""
        if self.host is not None:
            self.host.remove_expired()
        if self.backend is None:
            return None
        try:
            report = collect_garbage(self.backend, self.clock.now(), self.size_cap_bytes)
        except StoreUnavailable as exc:
            logger.warning("kv store garbage collection failed: %s", exc)
            self.metrics.add("errors")
            return None
        self.metrics.add("gc_runs")
        self.metrics.add("gc_removed_expired", report.removed_expired)
        self.metrics.add("gc_removed_for_size", report.removed_for_size)
        self.metrics.add("temporaries_removed", report.removed_temporaries)
        return report

    def _sweep(self) -> None:
        assert self.backend is not None
        try:
            removed = self.backend.sweep_temporaries()
        except StoreUnavailable as exc:
            logger.warning("kv store: could not remove temporary files at start: %s", exc)
            self.metrics.add("errors")
            return
        except Exception:
            logger.exception("kv store: removing temporary files at start failed unexpectedly")
            return
        self.metrics.add("temporaries_removed", removed)
        if removed:
            logger.info("kv store: removed %d temporary files of interrupted writes", removed)

    def _gc_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.gc()
            except Exception:
                logger.exception("kv store garbage collection failed unexpectedly")

    def writing(self, keys: Sequence[bytes]) -> bool:
        """Whether any of `keys` is still queued or being written to the persistent store."""
        return self._writer is not None and self._writer.pending(keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes to reach the store; False on timeout."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def metrics_snapshot(self) -> dict[str, float]:
        snapshot = self.metrics.snapshot()
        snapshot["write_queue_depth"] = self._writer.depth if self._writer is not None else 0
        snapshot["write_queue_bytes"] = self._writer.pending_bytes if self._writer is not None else 0
        snapshot["host_bytes"] = self.host.used_bytes if self.host is not None else 0
        snapshot["host_chunks"] = len(self.host) if self.host is not None else 0
        snapshot["read_breaker_state"] = int(self.read_breaker.state)
        snapshot["write_breaker_state"] = int(self.write_breaker.state)
        snapshot["breaker_opened_total"] = self.read_breaker.times_opened + self.write_breaker.times_opened
        return snapshot

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._writer is not None:
            self._writer.close(timeout)
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            self.backend.close()

    def __enter__(self) -> TieredKVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
