"""What a stored response is, and the interface every response store implements.

A record is one Responses API call: the `response` object as last known, the input items the
request added, and the ids of the conversation's earlier responses (oldest first), so that
`previous_response_id` rebuilds a conversation of any length from one lookup of each record.
Background responses also keep their stream events (SSE frames), numbered from 0 as their
`sequence_number`, for `GET /v1/responses/{id}?stream=true&starting_after=N`.

Records belong to a tenant (the API key, hashed): a lookup under another tenant finds nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Statuses after which a response changes no more (its last events may still be written).
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
ACTIVE_STATUSES = frozenset({"queued", "in_progress"})
ANONYMOUS_TENANT = "anonymous"


def tenant_of(api_key: str | None) -> str:
    """The tenant of a request: a hash of its API key (the key itself is never stored)."""
    if api_key is None:
        return ANONYMOUS_TENANT
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass(slots=True)
class StoredResponse:
    response_id: str
    tenant: str
    response: dict[str, Any]  # the `response` object, as GET /v1/responses/{id} returns it
    input_items: list[dict[str, Any]]  # the items this request added, as item resources (with ids)
    ancestors: list[str] = field(default_factory=list)  # earlier responses, oldest first
    traffic_class: str = "chat"
    background: bool = False
    done: bool = True  # False while a background run may still write events or a new status

    @property
    def status(self) -> str:
        return str(self.response.get("status"))


@dataclass(slots=True, frozen=True)
class EventsPage:
    """Stream events after a sequence number, with the record's state when they were read."""

    frames: list[str]
    status: str
    done: bool


class ResponseStore(Protocol):
    """Durable response records; every method is safe to call from several threads, and
    several processes (replicas) may share one store. Reads refresh a record's retention
    (its traffic class's TTL from now); expired records are invisible."""

    def put(self, record: StoredResponse, frames: Sequence[str] = ()) -> None:
        """Write a record (replacing one with its id), with its first stream events. May evict
        expired records, then the least recently used ones beyond the size cap."""
        ...

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The record, or None when it is missing, expired or another tenant's."""
        ...

    def get_many(self, tenant: str, response_ids: Sequence[str]) -> list[StoredResponse | None]:
        """`get` of each id, in one round trip where the store allows it."""
        ...

    def delete(self, tenant: str, response_id: str) -> bool:
        """Remove a record and its events; False when there was none."""
        ...

    def advance(
        self,
        tenant: str,
        response_id: str,
        frames: Sequence[str],
        response: dict[str, Any] | None = None,
        *,
        done: bool = False,
    ) -> str | None:
        """Append stream events and, if given, replace the response object; mark the record
        done. A cancelled record stays cancelled (the new object is kept with that status).
        Returns the stored status, or None when the record is gone."""
        ...

    def events_after(self, tenant: str, response_id: str, after: int) -> EventsPage | None:
        """Events with a sequence number above `after`; None when the record is gone."""
        ...

    def cancel(self, tenant: str, response_id: str, response: dict[str, Any]) -> StoredResponse | None:
        """If the record is queued or in progress, replace its object with `response` (status
        cancelled); return the record as stored afterwards (None when it is gone)."""
        ...

    def total_bytes(self) -> int:
        """Bytes the store's records hold (what the size cap bounds)."""
        ...

    def close(self) -> None: ...


def with_status(response: dict[str, Any], status: str) -> dict[str, Any]:
    return {**response, "status": status}
