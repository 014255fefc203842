from __future__ import annotations

import threading

import numpy as np

from deepinfer.store import ManualClock, TieredKVStore
from tests.store.conftest import kv_chunk, prefix_hashes, tiered

NS = b"model:smollm2|salt:"
BLOCK = 4


def _keys(store: TieredKVStore, n_chunks: int, namespace: bytes = NS) -> list[bytes]:
    tokens = list(range(1000, 1000 + n_chunks * store.blocks_per_chunk * BLOCK + 3))  # + a partial tail
    keys = store.chunk_keys(prefix_hashes(namespace, tokens, BLOCK))
    assert len(keys) == n_chunks
    return keys


def test_round_trip_through_the_persistent_store_is_bit_exact(make_backend, clock: ManualClock) -> None:
    chunks = [kv_chunk(i, dtype=dtype) for i, dtype in enumerate(["float16", "float32", "uint16", "int8"])]
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2) as writer:
        keys = _keys(writer, len(chunks))
        for key, chunk in zip(keys, chunks):
            assert writer.save(key, NS, chunk, num_tokens=8, traffic_class="chat")
        assert writer.flush(timeout=10)
        assert writer.metrics.writes == 4
    # A fresh store object (no host tier, nothing in memory) sees what the first one wrote.
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2) as reader:
        assert reader.lookup(keys, NS) == 4
        loaded = reader.load(keys, NS).result(timeout=10)
        assert len(loaded) == 4
        for got, want in zip(loaded, chunks):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
        assert reader.metrics.store_hits == 4
        assert reader.metrics.bytes_read > sum(c.nbytes for c in chunks)


def test_lookup_returns_the_longest_consecutive_run(make_backend, clock: ManualClock) -> None:
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2) as store:
        keys = _keys(store, 5)
        for i in (0, 1, 2, 4):  # chunk 3 missing
            store.save(keys[i], NS, kv_chunk(i), num_tokens=8, traffic_class="agent")
        store.flush(timeout=10)
        assert store.lookup(keys, NS) == 3
        assert store.lookup(keys[3:], NS) == 0
        assert store.lookup(keys[4:], NS) == 1
        assert len(store.load(keys, NS).result(timeout=10)) == 3
        assert store.metrics.misses == 2
        # Another namespace (a different salt) chains to different keys: nothing there.
        assert store.lookup(_keys(store, 5, NS + b"tenant-b"), NS + b"tenant-b") == 0


def test_host_tier_is_checked_first_and_mixes_with_the_store(make_backend, clock: ManualClock) -> None:
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2) as writer:
        keys = _keys(writer, 4)
        for i in (1, 2):
            writer.save(keys[i], NS, kv_chunk(i), num_tokens=8, traffic_class="chat")
        writer.flush(timeout=10)
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2, host_cache_bytes=1 << 20) as store:
        store.host.put(keys[0], NS, kv_chunk(0), ttl_s=60)
        store.host.put(keys[3], NS, kv_chunk(3), ttl_s=60)
        # host 0 | store 1, 2 | host 3: one run of four chunks
        assert store.lookup(keys, NS) == 4
        loaded = store.load(keys, NS).result(timeout=10)
        assert [a.tobytes() for a in loaded] == [kv_chunk(i).tobytes() for i in range(4)]
        assert (store.metrics.host_hits, store.metrics.store_hits) == (2, 2)
        # The store hits were promoted: the second load is served from memory alone.
        store.load(keys, NS).result(timeout=10)
        assert (store.metrics.host_hits, store.metrics.store_hits) == (6, 2)


def test_load_completes_in_the_background_with_a_callback(make_backend, clock: ManualClock) -> None:
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2) as store:
        keys = _keys(store, 2)
        for i, key in enumerate(keys):
            store.save(key, NS, kv_chunk(i), num_tokens=8, traffic_class="chat")
        store.flush(timeout=10)
        done = threading.Event()
        results: list[list[np.ndarray]] = []
        future = store.load(keys, NS)
        future.add_done_callback(lambda f: (results.append(f.result()), done.set()))
        assert done.wait(10)
        assert [a.tobytes() for a in results[0]] == [kv_chunk(0).tobytes(), kv_chunk(1).tobytes()]
        snapshot = store.metrics_snapshot()
        assert snapshot["loads"] == 1 and snapshot["load_seconds_total"] > 0
        assert snapshot["write_queue_depth"] == 0 and snapshot["read_breaker_state"] == 0


def test_rewriting_a_stored_chunk_only_refreshes_it(make_backend, clock: ManualClock) -> None:
    with tiered(backend=make_backend(), clock=clock, blocks_per_chunk=2) as store:
        key = _keys(store, 1)[0]
        store.save(key, NS, kv_chunk(0), num_tokens=8, traffic_class="chat")
        store.flush(timeout=10)
        written = store.metrics.bytes_written
        store.save(key, NS, kv_chunk(0), num_tokens=8, traffic_class="chat")
        store.flush(timeout=10)
        assert store.metrics.writes == 1 and store.metrics.writes_skipped_existing == 1
        assert store.metrics.bytes_written == written
