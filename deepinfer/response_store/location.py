"""Where stored responses live and how long they stay: parsing the server's options (no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from deepinfer.store.config import StoreLocation, parse_store_url
from deepinfer.store.retention import RetentionPolicy, parse_duration

OPTION = "--response-store"
SQLITE_FILE = "responses.sqlite3"


@dataclass(frozen=True, slots=True)
class ResponseStoreLocation:
    """`sqlite` with a path ("" = the cache directory's file), `redis` with its server, or `off`."""

    kind: Literal["sqlite", "redis", "off"]
    path: str = ""
    redis: StoreLocation | None = None


def parse_response_store(value: str) -> ResponseStoreLocation:
    """off | sqlite | sqlite:PATH | redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]."""
    text = value.strip()
    if text == "off":
        return ResponseStoreLocation("off")
    if text == "sqlite":
        return ResponseStoreLocation("sqlite")
    if text.startswith("sqlite:"):
        path = text.removeprefix("sqlite:").removeprefix("//")
        if not path:
            raise ValueError(f"{OPTION}: {value!r} names no file (sqlite:PATH)")
        return ResponseStoreLocation("sqlite", path=path)
    if text.startswith("redis://"):
        return ResponseStoreLocation("redis", redis=parse_store_url(text, option=OPTION))
    raise ValueError(f"{OPTION}: expected off, sqlite, sqlite:PATH or redis://HOST:PORT[/DB], got {value!r}")


def parse_retention_overrides(spec: str, option: str = "--response-retention") -> dict[str, float]:
    """'chat=1d,agent=12h' -> {class: seconds} (only the classes named)."""
    ttls: dict[str, float] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        name, sep, duration = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{option}: item {item.strip()!r} must look like CLASS=DURATION (e.g. chat=7d)")
        try:
            ttls[name.strip()] = parse_duration(duration)
        except ValueError as exc:
            raise ValueError(f"{option}: class {name.strip()!r}: {exc}") from None
    RetentionPolicy(ttls or {"chat": 1.0})  # checks the class names
    return ttls


def response_retention(kv_retention: RetentionPolicy, overrides: Mapping[str, float]) -> RetentionPolicy:
    """The KV store's retention per traffic class, with the classes the server option names
    replaced: every class a request may name keeps its responses for some time."""
    return RetentionPolicy({**kv_retention.ttls, **overrides})
