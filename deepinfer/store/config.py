"""Where the persistent KV store lives and how the tier stack is tuned: plain data, no I/O.

The user-facing options (`--kv-store`, `--kv-host-cache-bytes`, `--kv-retention`, ...) are
validated by `deepinfer.config.StoreConfig`, which builds a KVStoreConfig; `deepinfer.store.build`
turns it into the tier stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote, urlsplit

from deepinfer.store.retention import RetentionPolicy


@dataclass(slots=True, frozen=True)
class StoreLocation:
    kind: Literal["file", "redis"]
    path: str = ""
    host: str = ""
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_store_url(url: str, option: str = "--kv-store") -> StoreLocation:
    """DIR | file://DIR | redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]; errors name `option`."""
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
    # Seal chunks with AES-GCM (needs the cluster key) rather than a MAC alone: for stores that
    # other machines' administrators can read.
    encrypt: bool = False
    failure_threshold: int = 5
    probe_interval_s: float = 5.0
    lookup_timeout_s: float = 0.1
    redis_timeout_s: float = 1.0
    # Every process sharing a store may collect it; on a large fleet enable it on a few only.
    gc_interval_s: float | None = 600.0

    @property
    def enabled(self) -> bool:
        return self.location is not None or self.host_cache_bytes > 0
