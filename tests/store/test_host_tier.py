from __future__ import annotations

import numpy as np
import pytest

from deepinfer.store import ManualClock, StoreMetrics, chunk_keys
from deepinfer.store.host import HostTier
from tests.store.conftest import tiered

NS = b"ns"


def _array(nbytes: int, fill: int = 0) -> np.ndarray:
    return np.full(nbytes, fill, dtype=np.uint8)


def test_chunk_keys_are_the_last_block_hash_of_each_full_chunk() -> None:
    hashes = [bytes([i]) * 32 for i in range(11)]
    assert chunk_keys(hashes, 4) == [hashes[3], hashes[7]]
    assert chunk_keys(hashes, 1) == hashes
    assert chunk_keys(hashes[:3], 4) == []
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        chunk_keys(hashes, 0)


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    clock, metrics = ManualClock(), StoreMetrics()
    host = HostTier(300, clock, metrics)
    for name in (b"a", b"b", b"c"):
        assert host.put(name, NS, _array(100), ttl_s=60)
    assert host.get(b"a", NS) is not None  # a becomes most recent; b is now the oldest
    assert host.put(b"d", NS, _array(150), ttl_s=60)  # needs 150 bytes: evicts b, then c
    assert [k for k in (b"a", b"b", b"c", b"d") if host.contains(k, NS)] == [b"a", b"d"]
    assert host.used_bytes == 250
    assert metrics.host_evictions == 2


def test_too_large_is_refused_and_replacing_keeps_accounting() -> None:
    host = HostTier(100, ManualClock(), StoreMetrics())
    assert not host.put(b"big", NS, _array(101), ttl_s=60)
    assert host.put(b"k", NS, _array(60, 1), ttl_s=60)
    assert host.put(b"k", NS, _array(80, 2), ttl_s=60)
    assert host.used_bytes == 80 and len(host) == 1
    got = host.get(b"k", NS)
    assert got is not None and got[0] == 2 and not got.flags.writeable


def test_expiry_and_refresh_and_namespace() -> None:
    clock = ManualClock()
    host = HostTier(1000, clock, StoreMetrics())
    host.put(b"k", NS, _array(10), ttl_s=100)
    assert not host.contains(b"k", b"other-namespace")
    clock.advance(90)
    assert host.get(b"k", NS) is not None  # refreshed: now expires at 190
    clock.advance(90)
    assert host.contains(b"k", NS)
    clock.advance(11)
    assert host.get(b"k", NS) is None
    assert host.used_bytes == 0


def test_host_only_store_round_trip_and_class_ttl() -> None:
    clock = ManualClock()
    with tiered(host_cache_bytes=1 << 20, clock=clock, blocks_per_chunk=2) as store:
        array = np.arange(64, dtype=np.float16).reshape(2, 32)
        assert store.save(b"k1", NS, array, num_tokens=32, traffic_class="agent")
        assert store.save(b"k2", NS, array + 1, num_tokens=32, traffic_class="chat")
        assert store.lookup([b"k1", b"k2"], NS) == 2
        loaded = store.load([b"k1", b"k2"], NS).result(timeout=5)
        assert [a.tobytes() for a in loaded] == [array.tobytes(), (array + 1).tobytes()]
        clock.advance(3 * 86400 + 1)  # agent expired, chat alive
        assert store.lookup([b"k1"], NS) == 0
        assert store.lookup([b"k2"], NS) == 1
        with pytest.raises(ValueError, match="traffic_class 'bulk'"):
            store.save(b"k3", NS, array, num_tokens=32, traffic_class="bulk")
        with pytest.raises(TypeError, match="namespace"):
            store.save(b"k3", "ns", array, num_tokens=32, traffic_class="chat")  # type: ignore[arg-type]
        assert store.metrics.host_hits == 2
