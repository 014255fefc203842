from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import numpy as np

from deepinfer.store import BreakerState, CircuitBreaker, FileBackend, ManualClock
from tests.store.conftest import kv_chunk, tiered

NS = b"ns"


def _key(i: int) -> bytes:
    return hashlib.sha256(b"slow-%d" % i).digest()


class SlowBackend(FileBackend):
    """A real file backend behind a slow link: every write and lookup takes `delay` seconds.
    It counts the slow calls that have ended, so the tests assert on order (the caller had its
    answer before any slow call ended), which holds however busy the machine is."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__(root)
        self.delay = delay
        self.slow_lookups = False
        self.puts_done = 0
        self.slow_lookups_done = 0

    def put(self, key, parts, expires_at, now) -> None:
        time.sleep(self.delay)
        super().put(key, parts, expires_at, now)
        self.puts_done += 1

    def count_present(self, keys, now) -> int:
        if self.slow_lookups:
            time.sleep(self.delay)
            self.slow_lookups_done += 1
        return super().count_present(keys, now)


def test_full_write_queue_drops_instead_of_blocking(tmp_path: Path, clock: ManualClock) -> None:
    backend = SlowBackend(tmp_path / "store", delay=1.0)
    with tiered(backend=backend, clock=clock, write_queue_size=2) as store:
        accepted = [
            store.save(_key(i), NS, kv_chunk(i), num_tokens=8, traffic_class="chat") for i in range(12)
        ]
        assert backend.puts_done == 0  # all twelve answered before the first 1 s write ended
        # The worker holds at most one job and the queue two: everything else was dropped.
        assert 2 <= sum(accepted) <= 3
        assert store.metrics.write_drops == 12 - sum(accepted)
        assert store.metrics_snapshot()["write_queue_depth"] == sum(accepted)
        assert store.flush(timeout=10)
        assert store.metrics_snapshot()["write_queue_depth"] == 0
        stored = [store.lookup([_key(i)], NS) for i in range(12)]
        assert stored == [int(a) for a in accepted]
        assert store.metrics.writes == sum(accepted)


def test_slow_lookup_times_out_to_a_miss_and_opens_the_breaker(tmp_path: Path, clock: ManualClock) -> None:
    backend = SlowBackend(tmp_path / "store", delay=2.0)
    with tiered(
        backend=backend, clock=clock, lookup_timeout_s=0.05, failure_threshold=2, probe_interval_s=10
    ) as store:
        store.save(_key(0), NS, kv_chunk(0), num_tokens=8, traffic_class="chat")
        assert store.flush(timeout=10)
        assert store.lookup([_key(0)], NS) == 1
        backend.slow_lookups = True
        assert store.lookup([_key(0)], NS) == 0
        assert store.lookup([_key(0)], NS) == 0
        assert backend.slow_lookups_done == 0  # both missed at the 0.05 s deadline, not after 2 s
        assert store.metrics.lookup_timeouts == 2
        assert store.read_breaker.state is BreakerState.OPEN
        backend.slow_lookups = False
        deadline = time.monotonic() + 30
        while backend.slow_lookups_done < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the abandoned slow calls drain from the lookup threads
        clock.advance(10)
        assert store.lookup([_key(0)], NS) == 1


def test_breaker_opens_probes_and_closes(clock: ManualClock) -> None:
    breaker = CircuitBreaker(failure_threshold=3, probe_interval_s=5, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure("down")
    breaker.record_success()  # a success resets the count: errors must be consecutive
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure("down")
    assert breaker.state is BreakerState.OPEN and breaker.times_opened == 1
    assert not breaker.allow() and breaker.refusing()
    clock.advance(5)
    assert not breaker.refusing()
    assert breaker.allow()  # the probe
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # only one probe at a time
    breaker.record_failure("still down")
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.advance(5)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert breaker.times_opened == 1


class GatedBackend(FileBackend):
    """Reads that show the load's concurrency and ordering: the first two gets wait for each other
    (a barrier: they must be in flight together, or the test fails on its timeout, not on the
    clock), and the get of `held` waits until the test opens `release`."""

    def __init__(self, root: Path, held: bytes) -> None:
        super().__init__(root)
        self.together = threading.Barrier(2, timeout=30)
        self.gets = 0
        self.held = held
        self.release = threading.Event()
        self._count = threading.Lock()

    def get(self, key, now):
        with self._count:
            self.gets += 1
            first_two = self.gets <= 2
        if first_two:
            self.together.wait()
        if key == self.held:
            assert self.release.wait(timeout=30)
        return super().get(key, now)


def test_a_load_reads_ahead_and_hands_over_each_chunk_as_it_arrives(
    tmp_path: Path, clock: ManualClock
) -> None:
    keys = [_key(i) for i in range(4)]
    backend = GatedBackend(tmp_path / "store", held=keys[2])
    with tiered(backend=backend, clock=clock) as store:
        for i, key in enumerate(keys[:3]):  # the fourth chunk was never stored
            store.save(key, NS, kv_chunk(i), num_tokens=8, traffic_class="chat")
        assert store.flush(timeout=10)
        arrived: list[np.ndarray] = []
        future = store.load(keys, NS, arrived)
        deadline = time.monotonic() + 30
        while len(arrived) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Chunks 0 and 1 were read together (the barrier) and are delivered while chunk 2 is held.
        assert [a.tobytes() for a in arrived] == [kv_chunk(0).tobytes(), kv_chunk(1).tobytes()]
        assert not future.done()
        backend.release.set()
        result = future.result(timeout=30)
        assert result is arrived  # the list handed in is the result, in order, up to the gap
        assert [a.tobytes() for a in result] == [kv_chunk(i).tobytes() for i in range(3)]
        assert store.metrics.store_hits == 3 and store.metrics.misses == 1
