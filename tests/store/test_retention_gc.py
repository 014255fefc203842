from __future__ import annotations

import hashlib

from deepinfer.store import FileBackend, ManualClock, TieredKVStore, parse_retention
from tests.store.conftest import kv_chunk, tiered

NS = b"ns"
DAY = 86400.0


def _key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest()


def _store(backend, clock: ManualClock, **kwargs) -> TieredKVStore:
    return tiered(
        backend=backend, clock=clock, retention=parse_retention("agent=3d,chat=7d,batch=12h"), **kwargs
    )


def test_objects_expire_per_class_and_gc_removes_them(make_backend, clock: ManualClock) -> None:
    backend = make_backend()
    with _store(backend, clock) as store:
        for i, cls in enumerate(["batch", "agent", "chat"]):
            store.save(_key(i), NS, kv_chunk(i), num_tokens=8, traffic_class=cls)
        store.flush(timeout=10)
        visible = lambda: [store.lookup([_key(i)], NS) for i in range(3)]  # noqa: E731
        assert visible() == [1, 1, 1]
        clock.advance(12 * 3600 + 1)
        assert visible() == [0, 1, 1]  # batch gone at once, before any GC
        assert store.load([_key(0)], NS).result(timeout=10) == []
        clock.advance(3 * DAY)
        assert visible() == [0, 0, 1]
        assert len(store.load([_key(2)], NS).result(timeout=10)) == 1
        report = store.gc()
        assert report is not None
        assert (report.removed_expired, report.remaining_objects) == (2, 1)
        assert sorted(info.key for info in backend.scan()) == [_key(2)]
        assert store.metrics.gc_removed_expired == 2 and store.metrics.gc_runs == 1


def test_access_refreshes_expiry(make_backend, clock: ManualClock) -> None:
    with _store(make_backend(), clock) as store:
        store.save(_key(0), NS, kv_chunk(0), num_tokens=8, traffic_class="agent")
        store.save(_key(1), NS, kv_chunk(1), num_tokens=8, traffic_class="agent")
        store.flush(timeout=10)
        clock.advance(2 * DAY)
        assert len(store.load([_key(0)], NS).result(timeout=10)) == 1  # key 0 now lives until day 5
        clock.advance(1.5 * DAY)  # day 3.5
        assert store.lookup([_key(0)], NS) == 1
        assert store.lookup([_key(1)], NS) == 0
        clock.advance(1.5 * DAY + 1)  # past day 5
        assert store.lookup([_key(0)], NS) == 0


def test_rewriting_an_existing_chunk_extends_its_life(make_backend, clock: ManualClock) -> None:
    with _store(make_backend(), clock) as store:
        store.save(_key(0), NS, kv_chunk(0), num_tokens=8, traffic_class="agent")
        store.flush(timeout=10)
        clock.advance(2 * DAY)
        store.save(_key(0), NS, kv_chunk(0), num_tokens=8, traffic_class="agent")
        store.flush(timeout=10)
        clock.advance(2 * DAY)
        assert store.lookup([_key(0)], NS) == 1


def test_size_cap_removes_least_recently_accessed(make_backend, clock: ManualClock) -> None:
    backend = make_backend()
    with _store(backend, clock) as store:
        for i in range(5):
            store.save(_key(i), NS, kv_chunk(i), num_tokens=8, traffic_class="chat")
            store.flush(timeout=10)
            clock.advance(3600)
        store.load([_key(0)], NS).result(timeout=10)  # 0 is now the most recently used
        object_size = next(iter(backend.scan())).size
        store.size_cap_bytes = 3 * object_size + object_size // 2
        report = store.gc()
        assert report is not None
        assert (report.removed_expired, report.removed_for_size) == (0, 2)
        assert report.remaining_bytes <= store.size_cap_bytes
        assert sorted(info.key for info in backend.scan()) == sorted([_key(0), _key(3), _key(4)])
        assert [store.lookup([_key(i)], NS) for i in range(5)] == [1, 0, 0, 1, 1]
        assert store.metrics.gc_removed_for_size == 2


def test_gc_sweeps_leftovers_of_interrupted_writes(tmp_path, clock: ManualClock) -> None:
    backend = FileBackend(tmp_path / "store", tmp_max_age_s=3600)
    with _store(backend, clock) as store:
        store.save(_key(0), NS, kv_chunk(0), num_tokens=8, traffic_class="chat")
        store.flush(timeout=10)
        leftover = backend.path_for(_key(0)).with_name(f".{_key(0).hex()}.kv.123.456.dead.tmp")
        leftover.write_bytes(b"half an object")
        report = store.gc()
        assert report is not None and report.removed_temporaries == 0  # may be a write in progress
        backend.tmp_max_age_s = 0
        report = store.gc()
        assert report is not None and report.removed_temporaries == 1
        assert not leftover.exists()
        assert store.lookup([_key(0)], NS) == 1
