"""The server's options -> a response store (SQLite in the cache directory by default)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import redis

from deepinfer.response_store.location import SQLITE_FILE, ResponseStoreLocation
from deepinfer.response_store.records import ResponseStore
from deepinfer.response_store.redis_store import RedisResponseStore
from deepinfer.response_store.sqlite_store import SqliteResponseStore
from deepinfer.store.clock import SYSTEM_CLOCK, Clock
from deepinfer.store.config import StoreLocation
from deepinfer.store.retention import RetentionPolicy
from deepinfer.utils import cache_dir

log = logging.getLogger(__name__)

# What a store raises when its database cannot be reached or used (the server answers 503).
STORE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, redis.RedisError)


def resolve_location(
    location: ResponseStoreLocation | None, kv_store: StoreLocation | None
) -> ResponseStoreLocation:
    """The configured location; by default the KV store's Redis when it is one (replicas that
    share their KV cache share their responses), else SQLite in the cache directory."""
    if location is not None:
        return location
    if kv_store is not None and kv_store.kind == "redis":
        return ResponseStoreLocation("redis", redis=kv_store)
    return ResponseStoreLocation("sqlite")


def build_response_store(
    location: ResponseStoreLocation,
    *,
    retention: RetentionPolicy,
    max_bytes: int,
    clock: Clock = SYSTEM_CLOCK,
) -> ResponseStore | None:
    """The store at a resolved location; None for `off`."""
    if location.kind == "off":
        return None
    if location.kind == "redis":
        assert location.redis is not None
        server = location.redis
        log.info("stored responses: redis %s:%d/%d", server.host, server.port, server.db)
        return RedisResponseStore(
            server.host,
            server.port,
            server.db,
            username=server.username,
            password=server.password,
            retention=retention,
            max_bytes=max_bytes,
            clock=clock,
        )
    path = Path(location.path).expanduser() if location.path else cache_dir() / SQLITE_FILE
    log.info("stored responses: %s", path)
    return SqliteResponseStore(path, retention=retention, max_bytes=max_bytes, clock=clock)
