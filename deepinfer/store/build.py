"""KVStoreConfig -> the tier stack (host LRU + a directory or Redis backend)."""

from __future__ import annotations

import os
from collections.abc import Callable

from deepinfer.store.clock import SYSTEM_CLOCK, Clock
from deepinfer.store.config import KVStoreConfig
from deepinfer.store.file_backend import FileBackend
from deepinfer.store.objects import FORMAT_VERSION
from deepinfer.store.redis_backend import RedisBackend
from deepinfer.store.seal import ChunkSeal
from deepinfer.store.tiered import TieredKVStore


def build_kv_store(
    config: KVStoreConfig,
    *,
    clock: Clock = SYSTEM_CLOCK,
    on_host_evict: Callable[[bytes], None] | None = None,
    cluster_key: bytes | None = None,
) -> TieredKVStore | None:
    """The tier stack for `config`; None when neither a store nor a host cache is configured.
    `on_host_evict(key)` hears of every chunk the host tier drops (for KV events). With the
    deployment's `cluster_key`, stored chunks are authenticated with it (seal.py).

    Objects live under a format-version directory or key prefix, so engines of different
    format versions can share one store during a rolling upgrade without blocking each other.
    """
    if not config.enabled:
        return None
    backend: FileBackend | RedisBackend | None = None
    location = config.location
    if location is not None and location.kind == "file":
        root = os.path.join(os.path.abspath(os.path.expanduser(location.path)), f"v{FORMAT_VERSION}")
        backend = FileBackend(root, fsync=config.fsync)
    elif location is not None:
        backend = RedisBackend(
            location.host,
            location.port,
            location.db,
            username=location.username,
            password=location.password,
            key_prefix=f"deepinfer:kv:v{FORMAT_VERSION}:",
            socket_timeout_s=config.redis_timeout_s,
        )
    return TieredKVStore(
        retention=config.retention,
        blocks_per_chunk=config.blocks_per_chunk,
        host_cache_bytes=config.host_cache_bytes,
        backend=backend,
        clock=clock,
        failure_threshold=config.failure_threshold,
        probe_interval_s=config.probe_interval_s,
        write_queue_size=config.write_queue_size,
        write_queue_bytes=config.write_queue_bytes,
        size_cap_bytes=config.size_cap_bytes,
        lookup_timeout_s=config.lookup_timeout_s,
        gc_interval_s=config.gc_interval_s,
        on_host_evict=on_host_evict,
        seal=ChunkSeal(cluster_key, encrypt=config.encrypt),
    )
