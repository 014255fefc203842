from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from deepinfer.store import (
    FORMAT_VERSION,
    BreakerState,
    FileBackend,
    ManualClock,
    RedisBackend,
    TieredKVStore,
)
from tests.store import workers
from tests.store.conftest import kv_chunk, tiered
from tests.store.redis_server import RedisServer

NS = b"model:A|salt:s1"
REPO = Path(__file__).resolve().parents[2]


def _key(i: int) -> bytes:
    return hashlib.sha256(b"fault-%d" % i).digest()


@pytest.fixture
def file_store(tmp_path: Path, clock: ManualClock) -> Iterator[tuple[TieredKVStore, FileBackend]]:
    backend = FileBackend(tmp_path / "store")
    with tiered(backend=backend, clock=clock, blocks_per_chunk=2) as store:
        for i in range(3):
            store.save(_key(i), NS, kv_chunk(i), num_tokens=8, traffic_class="chat")
        assert store.flush(timeout=10)
        yield store, backend


def _load(store: TieredKVStore, keys: list[bytes], namespace: bytes = NS) -> list[bytes]:
    return [a.tobytes() for a in store.load(keys, namespace).result(timeout=10)]


def test_truncated_object_is_a_miss_and_is_removed(file_store) -> None:
    store, backend = file_store
    path = backend.path_for(_key(1))
    os.truncate(path, path.stat().st_size - 10)
    assert _load(store, [_key(0), _key(1), _key(2)]) == [kv_chunk(0).tobytes()]
    assert store.metrics.corrupt_objects == 1 and store.metrics.errors == 1
    assert not path.exists()  # the next writer of this chunk can replace it


def test_flipped_payload_byte_is_a_miss(file_store) -> None:
    store, backend = file_store
    path = backend.path_for(_key(0))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x04
    path.write_bytes(data)
    os.utime(path, (0, 4e9))  # keep it unexpired after the rewrite
    assert _load(store, [_key(0)]) == []
    assert store.metrics.corrupt_objects == 1


def test_wrong_version_header_is_a_miss_but_left_alone(file_store) -> None:
    store, backend = file_store
    path = backend.path_for(_key(0))
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<H", FORMAT_VERSION + 1))
    assert _load(store, [_key(0)]) == []
    assert store.metrics.foreign_objects == 1 and store.metrics.corrupt_objects == 0
    assert path.exists()  # may belong to a newer engine sharing the store


def test_key_from_another_namespace_is_a_miss(file_store) -> None:
    store, _ = file_store
    assert _load(store, [_key(0)], b"model:B|salt:s1") == []  # another model fingerprint
    assert _load(store, [_key(0)], b"model:A|salt:s2") == []  # another cache salt
    assert store.metrics.foreign_objects == 2
    assert _load(store, [_key(0)]) == [kv_chunk(0).tobytes()]


def test_object_under_the_wrong_key_is_a_miss(file_store) -> None:
    store, backend = file_store
    shutil.copyfile(backend.path_for(_key(0)), backend.path_for(_key(1)))
    os.utime(backend.path_for(_key(1)), (0, 4e9))
    assert _load(store, [_key(1)]) == []
    assert store.metrics.foreign_objects == 1


def test_redis_returning_garbage_is_a_miss(redis_server: RedisServer, clock: ManualClock) -> None:
    backend = RedisBackend("127.0.0.1", redis_server.port, key_prefix="g:")
    with tiered(backend=backend, clock=clock, blocks_per_chunk=2) as store:
        store.save(_key(0), NS, kv_chunk(0), num_tokens=8, traffic_class="chat")
        store.save(_key(1), NS, kv_chunk(1), num_tokens=8, traffic_class="chat")
        store.flush(timeout=10)
        raw = redis.Redis(port=redis_server.port)
        raw.hset("g:" + _key(0).hex(), "d", os.urandom(300))
        raw.hset("g:" + _key(1).hex(), "e", "soon")
        assert _load(store, [_key(0)]) == []
        assert _load(store, [_key(1)]) == []
        assert store.metrics.corrupt_objects == 1 and store.metrics.errors == 2
        raw.close()


def _set_dir_modes(root: Path, mode: int) -> None:
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, mode)


def test_read_only_store_fails_writes_softly_and_still_serves_reads(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    workers.write_through_store(str(root), [0, 1, 2], "chat")
    _set_dir_modes(root, 0o555)
    try:
        # Another process; as root it first gives up the right to ignore permissions.
        result = subprocess.run(
            [sys.executable, "-m", "tests.store.workers", str(root), "[0, 1, 2]", "100"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        _set_dir_modes(root, 0o755)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["save_seconds"] < 1.0
    assert report["flushed"] is True
    assert report["lookup"] == 3
    assert report["digests"] == [hashlib.sha256(workers.chunk_of(i).tobytes()).hexdigest() for i in range(3)]
    assert report["new_lookup"] == 0
    metrics = report["metrics"]
    assert metrics["writes"] == 0
    assert metrics["errors"] >= 5  # every failed write is counted
    assert metrics["store_hits"] == 3
    assert metrics["write_breaker_state"] == int(BreakerState.OPEN)
    assert metrics["read_breaker_state"] == int(BreakerState.CLOSED)
    assert metrics["write_drops"] >= 1  # once the write breaker opened, writes were dropped at once


def test_redis_killed_mid_run_gives_misses_then_reconnects(
    redis_server: RedisServer, clock: ManualClock
) -> None:
    backend = RedisBackend("127.0.0.1", redis_server.port, key_prefix="k:", socket_timeout_s=1.0)
    with tiered(
        backend=backend, clock=clock, blocks_per_chunk=2, failure_threshold=3, probe_interval_s=30
    ) as store:
        keys = [_key(i) for i in range(3)]
        for i, key in enumerate(keys):
            store.save(key, NS, kv_chunk(i), num_tokens=8, traffic_class="agent")
        assert store.flush(timeout=10)
        assert store.lookup(keys, NS) == 3

        redis_server.kill()
        assert store.lookup(keys, NS) == 0
        assert _load(store, keys) == []
        assert store.lookup(keys, NS) == 0
        assert store.read_breaker.state is BreakerState.OPEN
        errors = store.metrics.errors
        for _ in range(50):  # open breaker: answered at once, the dead store is not even asked
            assert store.lookup(keys, NS) == 0
        assert store.metrics.errors == errors  # not one more connection attempt
        assert store.metrics_snapshot()["read_breaker_state"] == int(BreakerState.OPEN)

        redis_server.start()  # same port; its append-only file brings the data back
        assert store.lookup(keys, NS) == 0  # still open until the next probe is due
        clock.advance(31)
        assert store.lookup(keys, NS) == 3  # the probe succeeds and closes the breaker
        assert store.read_breaker.state is BreakerState.CLOSED
        assert _load(store, keys) == [kv_chunk(i).tobytes() for i in range(3)]
        # Writes work again too.
        assert store.save(_key(9), NS, kv_chunk(9), num_tokens=8, traffic_class="agent")
        assert store.flush(timeout=10)
        assert store.lookup([_key(9)], NS) == 1
