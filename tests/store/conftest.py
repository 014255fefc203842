from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from deepinfer.store import FileBackend, ManualClock, RedisBackend, TieredKVStore
from tests.store.redis_server import RedisServer, redis_server  # noqa: F401 (a fixture)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["file", "redis"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_backend(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest):
    """A fresh persistent backend of the parametrized kind (file directory or real Redis)."""
    if backend_kind == "file":
        return lambda: FileBackend(tmp_path / "store")
    server: RedisServer = request.getfixturevalue("redis_server")
    return lambda: RedisBackend("127.0.0.1", server.port, key_prefix="test:kv:")


def prefix_hashes(namespace: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained block hashes like the engine's: parent hash + the block's token ids, from the namespace."""
    parent = hashlib.sha256(b"ns" + namespace).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = np.asarray(token_ids[start : start + block_size], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


def kv_chunk(seed: int, tokens: int = 8, dtype: str = "float16") -> np.ndarray:
    """A chunk shaped like real KV: (layers, k/v, tokens, kv heads, head dim)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 2, tokens, 2, 4)).astype(dtype)


def tiered(**kwargs) -> TieredKVStore:
    """A store with a generous lookup deadline, so a busy 2-core CI box never turns hits into misses."""
    kwargs.setdefault("lookup_timeout_s", 5.0)
    return TieredKVStore(**kwargs)
