"""CLI options -> KVStoreConfig -> the tier stack.

--kv-store DIR | file://DIR | redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]
--kv-host-cache-bytes N      (plain bytes or 512MiB, 8GiB, 2GB, ...)
--kv-retention agent=3d,chat=7d[,batch=12h]
--kv-store-max-bytes N       (size cap enforced by the garbage collector)
--kv-chunk-blocks C          (full blocks per stored chunk)
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote, urlsplit

from deepinfer.store.clock import SYSTEM_CLOCK, Clock
from deepinfer.store.file_backend import FileBackend
from deepinfer.store.objects import FORMAT_VERSION
from deepinfer.store.redis_backend import RedisBackend
from deepinfer.store.retention import RetentionPolicy, parse_retention
from deepinfer.store.tiered import TieredKVStore

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str | int, option: str = "size") -> int:
    """'1048576', '512MiB', '8GiB', '2GB' -> bytes. A bare K/M/G/T is read as binary (KiB...)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        if match is None:
            raise ValueError(f"{option}: {text!r} is not a byte size such as 1048576, 512MiB or 8GiB")
        unit = (match.group(2) or "b").lower()
        if unit in {"k", "m", "g", "t"}:
            unit += "ib"
        elif len(unit) == 2 and unit[1] == "i":
            unit += "b"
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 0:
        raise ValueError(f"{option}: must be >= 0, got {value}")
    return value


@dataclass(slots=True, frozen=True)
class StoreLocation:
    kind: Literal["file", "redis"]
    path: str = ""
    host: str = ""
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_store_url(url: str) -> StoreLocation:
    """DIR | file://DIR | redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]."""
    option = "--kv-store"
    if not url or not url.strip():
        raise ValueError(f"{option}: empty; give a directory, file://DIR or redis://HOST:PORT[/DB]")
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path:
            raise ValueError(f"{option}: {url!r} names no directory")
        return StoreLocation("file", path=path)
    if "://" not in url:
        return StoreLocation("file", path=url)
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(
            f"{option}: unsupported scheme {parts.scheme!r} in {url!r} (use a directory, file:// or redis://)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{option}: {url!r} must not carry a query or fragment")
    if not parts.hostname:
        raise ValueError(f"{option}: {url!r} names no host")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"{option}: {url!r} has an invalid port") from None
    db_text = parts.path.strip("/")
    if db_text and not db_text.isdigit():
        raise ValueError(f"{option}: database {db_text!r} in {url!r} must be a number")
    return StoreLocation(
        "redis",
        host=parts.hostname,
        port=port,
        db=int(db_text or 0),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


@dataclass(slots=True, frozen=True)
class KVStoreConfig:
    location: StoreLocation | None = None
    host_cache_bytes: int = 0
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    blocks_per_chunk: int = 16
    size_cap_bytes: int | None = None
    write_queue_size: int = 64
    write_queue_bytes: int | None = 1 << 30
    fsync: bool = True
    failure_threshold: int = 5
    probe_interval_s: float = 5.0
    lookup_timeout_s: float = 0.1
    redis_timeout_s: float = 1.0
    # Every process sharing a store may collect it; on a large fleet enable it on a few only.
    gc_interval_s: float | None = 600.0

    @property
    def enabled(self) -> bool:
        return self.location is not None or self.host_cache_bytes > 0

    @classmethod
    def from_cli(
        cls,
        kv_store: str | None = None,
        kv_host_cache_bytes: str | int | None = None,
        kv_retention: str | None = None,
        kv_store_max_bytes: str | int | None = None,
        kv_chunk_blocks: int | None = None,
    ) -> KVStoreConfig:
        return cls(
            location=parse_store_url(kv_store) if kv_store else None,
            host_cache_bytes=parse_bytes(kv_host_cache_bytes, "--kv-host-cache-bytes")
            if kv_host_cache_bytes is not None
            else 0,
            retention=parse_retention(kv_retention) if kv_retention else RetentionPolicy(),
            size_cap_bytes=parse_bytes(kv_store_max_bytes, "--kv-store-max-bytes")
            if kv_store_max_bytes is not None
            else None,
            blocks_per_chunk=kv_chunk_blocks if kv_chunk_blocks is not None else 16,
        )


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV store (prefix cache beyond device memory)")
    group.add_argument("--kv-store", default=None, help="DIR | file://DIR | redis://HOST:PORT[/DB]")
    group.add_argument("--kv-host-cache-bytes", default=None, help="host-memory tier size, e.g. 8GiB")
    group.add_argument("--kv-retention", default=None, help="TTL per traffic class, e.g. agent=3d,chat=7d")
    group.add_argument("--kv-store-max-bytes", default=None, help="size cap of the persistent store")
    group.add_argument("--kv-chunk-blocks", type=int, default=None, help="full blocks per stored chunk")


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    return KVStoreConfig.from_cli(
        args.kv_store,
        args.kv_host_cache_bytes,
        args.kv_retention,
        args.kv_store_max_bytes,
        args.kv_chunk_blocks,
    )


def build_kv_store(config: KVStoreConfig, *, clock: Clock = SYSTEM_CLOCK) -> TieredKVStore | None:
    """The tier stack for `config`; None when neither a store nor a host cache is configured.

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
    )
