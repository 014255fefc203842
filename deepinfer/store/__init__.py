"""KV tiers beyond device memory: a host-memory LRU and a persistent shared store (directory or Redis).

The engine talks to `KVStore` (see api.py); `build_kv_store(KVStoreConfig.from_cli(...))` builds it.
"""

from __future__ import annotations

from deepinfer.store.api import KVStore, chunk_keys
from deepinfer.store.backend import ObjectInfo, PersistentBackend, StoreUnavailable
from deepinfer.store.breaker import BreakerState, CircuitBreaker
from deepinfer.store.clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock
from deepinfer.store.config import (
    KVStoreConfig,
    StoreLocation,
    add_cli_arguments,
    build_kv_store,
    config_from_args,
    parse_bytes,
    parse_store_url,
)
from deepinfer.store.file_backend import FileBackend
from deepinfer.store.gc import GcReport, collect_garbage
from deepinfer.store.metrics import StoreMetrics
from deepinfer.store.objects import FORMAT_VERSION, decode_object, encode_object
from deepinfer.store.redis_backend import RedisBackend
from deepinfer.store.retention import RetentionPolicy, parse_duration, parse_retention
from deepinfer.store.tiered import TieredKVStore

__all__ = [
    "FORMAT_VERSION",
    "SYSTEM_CLOCK",
    "BreakerState",
    "CircuitBreaker",
    "Clock",
    "FileBackend",
    "GcReport",
    "KVStore",
    "KVStoreConfig",
    "ManualClock",
    "ObjectInfo",
    "PersistentBackend",
    "RedisBackend",
    "RetentionPolicy",
    "StoreLocation",
    "StoreMetrics",
    "StoreUnavailable",
    "SystemClock",
    "TieredKVStore",
    "add_cli_arguments",
    "build_kv_store",
    "chunk_keys",
    "collect_garbage",
    "config_from_args",
    "decode_object",
    "encode_object",
    "parse_bytes",
    "parse_duration",
    "parse_retention",
    "parse_store_url",
]
