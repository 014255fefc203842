from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deepinfer.response_store import RedisResponseStore, ResponseStore, SqliteResponseStore
from deepinfer.store import ManualClock, RetentionPolicy
from tests.store.redis_server import RedisServer, redis_server  # noqa: F401 (a fixture)

RETENTION = RetentionPolicy({"chat": 3600.0, "agent": 60.0})


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


StoreFactory = Callable[..., ResponseStore]


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock) -> Iterator[StoreFactory]:
    """Opens a store of the parametrized kind; each call is another process's view of the same
    database (a second replica, or the server after a restart)."""
    opened: list[ResponseStore] = []

    def make(max_bytes: int = 1 << 30) -> ResponseStore:
        store: ResponseStore
        if request.param == "sqlite":
            store = SqliteResponseStore(
                tmp_path / "responses.sqlite3", retention=RETENTION, max_bytes=max_bytes, clock=clock
            )
        else:
            server: RedisServer = request.getfixturevalue("redis_server")
            store = RedisResponseStore(
                "127.0.0.1", server.port, retention=RETENTION, max_bytes=max_bytes, clock=clock
            )
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
