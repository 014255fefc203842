"""KV tiers beyond device memory: a host-memory LRU and a persistent shared store (directory or Redis).

The engine talks to `KVStore` (see api.py); `build_kv_store(KVStoreConfig(...))` builds it (`deepinfer.config.StoreConfig` validates the options).
"""

from __future__ import annotations

from deepinfer.store.api import KVStore, chunk_keys
from deepinfer.store.backend import ObjectInfo, PersistentBackend, StoreUnavailable
from deepinfer.store.breaker import BreakerState, CircuitBreaker
from deepinfer.store.build import build_kv_store
from deepinfer.store.clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock
from deepinfer.store.config import KVStoreConfig, StoreLocation, parse_store_url
from deepinfer.store.file_backend import FileBackend
from deepinfer.store.gc import GcReport, collect_garbage
from deepinfer.store.metrics import StoreMetrics
from deepinfer.store.objects import FORMAT_VERSION, decode_object, encode_object
from deepinfer.store.redis_backend import RedisBackend
from deepinfer.store.retention import DEFAULT_TRAFFIC_CLASS, RetentionPolicy, parse_duration, parse_retention
from deepinfer.store.tiered import TieredKVStore

__all__ = [
    "DEFAULT_TRAFFIC_CLASS",
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
    "build_kv_store",
    "chunk_keys",
    "collect_garbage",
    "decode_object",
    "encode_object",
    "parse_duration",
    "parse_retention",
    "parse_store_url",
]
