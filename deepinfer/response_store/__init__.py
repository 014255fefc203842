"""Stored Responses API objects: `store: true` responses, their input items, and the events of
background responses, in SQLite (embedded default) or Redis (shared by replicas). Torch-free.

The server talks to `ResponseStore` (records.py); `build_response_store` builds one from the
server's options (`--response-store`, `--response-retention`, `--response-store-max-bytes`).
"""

from __future__ import annotations

from deepinfer.response_store.build import build_response_store, resolve_location
from deepinfer.response_store.location import (
    ResponseStoreLocation,
    parse_response_store,
    parse_retention_overrides,
    response_retention,
)
from deepinfer.response_store.records import (
    ACTIVE_STATUSES,
    ANONYMOUS_TENANT,
    TERMINAL_STATUSES,
    EventsPage,
    ResponseStore,
    StoredResponse,
    tenant_of,
)
from deepinfer.response_store.redis_store import RedisResponseStore
from deepinfer.response_store.sqlite_store import SqliteResponseStore

__all__ = [
    "ACTIVE_STATUSES",
    "ANONYMOUS_TENANT",
    "TERMINAL_STATUSES",
    "EventsPage",
    "RedisResponseStore",
    "ResponseStore",
    "ResponseStoreLocation",
    "SqliteResponseStore",
    "StoredResponse",
    "build_response_store",
    "parse_response_store",
    "parse_retention_overrides",
    "resolve_location",
    "response_retention",
    "tenant_of",
]
