"""Code that runs in separate processes for the multi-process store tests (spawned, so importable)."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import sys
import time

import numpy as np

from deepinfer.config import StoreConfig
from deepinfer.store import FileBackend, KVStoreConfig, RedisBackend, build_kv_store, encode_object

NAMESPACE = b"model-fp|salt"
_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE = 1


def _config(url: str) -> KVStoreConfig:
    # The public CLI path, with a lookup deadline generous enough for a busy 2-core CI box.
    return dataclasses.replace(StoreConfig(kv_store=url, kv_chunk_blocks=2).settings(), lookup_timeout_s=5.0)


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"chunk-%d" % i).digest()


def chunk_of(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((2, 2, 16, 2, 8)).astype(np.float16)


def write_through_store(url: str, indices: list[int], traffic_class: str) -> dict[str, float]:
    """Another engine process: save chunks through the public factory and wait for them to land."""
    store = build_kv_store(_config(url))
    assert store is not None
    for i in indices:
        assert store.save(key_of(i), NAMESPACE, chunk_of(i), num_tokens=32, traffic_class=traffic_class)
    assert store.flush(timeout=30)
    snapshot = store.metrics_snapshot()
    store.close()
    return snapshot


def read_through_store(url: str, indices: list[int]) -> tuple[int, list[bytes]]:
    """Another engine process: look up and load; returns the lookup count and the raw payloads."""
    store = build_kv_store(_config(url))
    assert store is not None
    keys = [key_of(i) for i in indices]
    found = store.lookup(keys, NAMESPACE)
    arrays = store.load(keys, NAMESPACE).result(timeout=30)
    store.close()
    return found, [a.tobytes() for a in arrays]


def writer_payload(writer: int, i: int) -> np.ndarray:
    # Writers differ in payload size, so a torn or interleaved write could not pass the length check.
    return np.full(4096 + 512 * writer, writer * 1000 + i, dtype=np.int32)


def race_writes(
    kind: str, location: str, writer: int, keys: int, rounds: int, start_at: float
) -> tuple[int, float, float]:
    """Write the same keys as the other writers, as close to the same instant as we can."""
    if kind == "file":
        backend = FileBackend(location)
    else:
        host, port = location.split(":")
        backend = RedisBackend(host, int(port), key_prefix="race:")
    while time.time() < start_at:
        time.sleep(0.001)
    began = time.time()
    writes = 0
    for _ in range(rounds):
        for i in range(keys):
            parts = encode_object(key_of(i), NAMESPACE, "chat", 1, writer_payload(writer, i))
            backend.put(key_of(i), parts, expires_at=time.time() + 3600, now=time.time())
            writes += 1
    backend.close()
    return writes, began, time.time()


def read_only_probe(root: str, indices: list[int], new_index: int) -> None:
    """Run against a store this process cannot write: prints a JSON report on stdout."""
    store = build_kv_store(_config(root))
    assert store is not None
    keys = [key_of(i) for i in indices]
    report: dict[str, object] = {}
    started = time.perf_counter()
    accepted = [
        store.save(
            key_of(new_index + n), NAMESPACE, chunk_of(new_index + n), num_tokens=32, traffic_class="chat"
        )
        for n in range(8)
    ]
    report["save_seconds"] = time.perf_counter() - started
    report["accepted"] = accepted
    report["flushed"] = store.flush(timeout=30)
    report["lookup"] = store.lookup(keys, NAMESPACE)
    report["digests"] = [
        hashlib.sha256(a.tobytes()).hexdigest() for a in store.load(keys, NAMESPACE).result(timeout=30)
    ]
    report["new_lookup"] = store.lookup([key_of(new_index)], NAMESPACE)
    report["metrics"] = store.metrics_snapshot()
    store.close()
    json.dump(report, sys.stdout)


def _without_root_override() -> None:
    """As root, permissions do not stop writes: drop CAP_DAC_OVERRIDE from the bounding set and
    re-exec, so this process obeys the read-only directory like any other user would."""
    if os.geteuid() != 0 or os.environ.get("KVSTORE_PROBE_REEXECED"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE) failed")
    os.environ["KVSTORE_PROBE_REEXECED"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "tests.store.workers", *sys.argv[1:]])


if __name__ == "__main__":
    _without_root_override()
    read_only_probe(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))
