from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis

from deepinfer.store import FileBackend, RedisBackend, decode_object
from tests.store import workers
from tests.store.redis_server import RedisServer

WRITERS = 4
KEYS = 6
ROUNDS = 15


def _pool(n: int) -> ProcessPoolExecutor:
    # spawn: each worker is a fresh interpreter, like another engine process on another machine.
    return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))


def _store_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "file":
        return f"file://{tmp_path / 'shared'}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_what_one_process_writes_another_reads(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = _store_url(kind, tmp_path, request)
    with _pool(1) as writer_pool, _pool(1) as reader_pool:
        written = writer_pool.submit(workers.write_through_store, url, [0, 1, 2, 3], "agent").result(
            timeout=60
        )
        assert written["writes"] == 4 and written["errors"] == 0
        found, payloads = reader_pool.submit(workers.read_through_store, url, [0, 1, 2, 3, 4]).result(
            timeout=60
        )
    assert found == 4
    assert payloads == [workers.chunk_of(i).tobytes() for i in range(4)]


def _stored_objects(kind: str, location: str) -> dict[bytes, bytes]:
    if kind == "file":
        backend = FileBackend(location)
        leftovers = [p for p in Path(location).rglob("*") if p.is_file() and not p.name.endswith(".kv")]
        assert leftovers == []  # no temporary file survived
        objects = {info.key: bytes(backend.get(info.key, time.time())) for info in backend.scan()}
    else:
        host, port = location.split(":")
        client = redis.Redis(host=host, port=int(port))
        names = sorted(client.scan_iter(match="race:*"))
        objects = {bytes.fromhex(n[len("race:") :].decode()): client.hget(n, "d") for n in names}
        client.close()
        backend = RedisBackend(host, int(port), key_prefix="race:")
        assert sorted(info.key for info in backend.scan()) == sorted(objects)
        backend.close()
    return objects


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_concurrent_writers_of_the_same_keys_leave_one_valid_object_each(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "file":
        location = str(tmp_path / "race")
    else:
        location = f"127.0.0.1:{request.getfixturevalue('redis_server').port}"
    start_at = time.time() + 2.0  # all writers are up by then and start together
    with _pool(WRITERS) as pool:
        futures = [
            pool.submit(workers.race_writes, kind, location, w, KEYS, ROUNDS, start_at)
            for w in range(WRITERS)
        ]
        results = [f.result(timeout=120) for f in futures]
    assert [writes for writes, _, _ in results] == [KEYS * ROUNDS] * WRITERS
    # The writers really ran at the same time: every writing interval overlaps every other.
    assert max(began for _, began, _ in results) < min(ended for _, _, ended in results)
    objects = _stored_objects(kind, location)
    assert sorted(objects) == sorted(workers.key_of(i) for i in range(KEYS))
    for i in range(KEYS):
        decoded = decode_object(objects[workers.key_of(i)], workers.key_of(i), workers.NAMESPACE)
        # Whole and from a single writer: equal to exactly one writer's payload.
        matches = [w for w in range(WRITERS) if np.array_equal(decoded.array, workers.writer_payload(w, i))]
        assert len(matches) == 1
