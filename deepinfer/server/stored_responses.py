"""The server's side of stored responses: store calls off the event loop, their errors as API
errors, conversations rebuilt from `previous_response_id`, and background runs.

The store is synchronous (sqlite3, redis-py); each call runs on a worker thread so that a slow
disk or network never stalls the streams of other requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deepinfer.config import EngineConfig, ServerConfig
from deepinfer.recipe.api.responses_items import output_as_input
from deepinfer.response_store import (
    ACTIVE_STATUSES,
    ResponseStore,
    StoredResponse,
    build_response_store,
    parse_response_store,
    parse_retention_overrides,
    resolve_location,
    response_retention,
)
from deepinfer.response_store.build import STORE_ERRORS
from deepinfer.server.background_runs import BackgroundRuns
from deepinfer.server.errors import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")

_OFF = "this server keeps no responses (--response-store off)"


def open_response_store(engine_config: EngineConfig, server_config: ServerConfig) -> ResponseStore | None:
    """The store the options name (None: `--response-store off`); classes keep their KV
    retention unless `--response-retention` names them."""
    configured = server_config.response_store
    location = resolve_location(
        parse_response_store(configured) if configured else None, engine_config.store.location
    )
    retention = response_retention(
        engine_config.store.retention, parse_retention_overrides(server_config.response_retention or "")
    )
    return build_response_store(
        location, retention=retention, max_bytes=server_config.response_store_max_bytes
    )


@dataclass(slots=True)
class Continuation:
    """What a `previous_response_id` brings: the earlier turns' items (oldest first) and the ids
    of the responses they came from, which the new record lists as its ancestors."""

    items: list[dict[str, Any]] = field(default_factory=list)
    ancestors: list[str] = field(default_factory=list)


class StoredResponses:
    """Stored responses for the routes; `store` None: storing is off (nothing is kept)."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store
        self.background = BackgroundRuns(store, self.call)

    @property
    def enabled(self) -> bool:
        return self.store is not None

    async def call(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A store method on a worker thread; a store that cannot be reached is a 503."""
        try:
            return await asyncio.to_thread(method, *args, **kwargs)
        except STORE_ERRORS as error:
            log.warning("response store error: %s", error)
            # The store's own message names its host and port: the log keeps it, the client
            # learns only that the store is down.
            raise ApiError(
                503,
                "the response store is unavailable; retry later",
                code="response_store_unavailable",
                headers={"retry-after": "1"},
            ) from None

    def _store(self) -> ResponseStore:
        if self.store is None:
            raise ApiError(404, _OFF, code="not_found")
        return self.store

    # -- records -------------------------------------------------------------------------------

    async def save(self, record: StoredResponse, frames: Sequence[str] = ()) -> None:
        await self.call(self._store().put, record, frames)

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The record; 404 when it is missing, expired or another API key's."""
        record = await self.call(self._store().get, tenant, response_id)
        if record is None:
            raise not_found(response_id)
        return record

    async def delete(self, tenant: str, response_id: str) -> None:
        if not await self.call(self._store().delete, tenant, response_id):
            raise not_found(response_id)

    async def conversation(self, tenant: str, response_id: str) -> list[StoredResponse]:
        """A response and every earlier one of its conversation, oldest first; 404 when it is
        gone, or when an earlier one is (deleted, expired or evicted by the size cap)."""
        record = await self.get(tenant, response_id)
        earlier = await self.call(self._store().get_many, tenant, record.ancestors)
        for ancestor_id, ancestor in zip(record.ancestors, earlier):
            if ancestor is None:
                raise ApiError(
                    404,
                    f"the conversation of response {response_id!r} is incomplete: its earlier response "
                    f"{ancestor_id!r} is no longer stored (deleted, expired, or evicted by the size cap)",
                    code="not_found",
                )
        return [*(r for r in earlier if r is not None), record]

    async def continuation(self, tenant: str, previous_id: str | None) -> Continuation:
        """The items a `previous_response_id` stands for; 400 naming the field when it cannot."""
        if previous_id is None:
            return Continuation()
        if self.store is None:
            raise ApiError(400, f"previous_response_id: {_OFF}", param="previous_response_id")
        try:
            chain = await self.conversation(tenant, previous_id)
        except ApiError as error:
            if error.status != 404:
                raise
            raise ApiError(
                400,
                f"previous_response_id: {error.message}",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None
        last = chain[-1]
        if last.status in ACTIVE_STATUSES:
            raise ApiError(
                400,
                f"previous_response_id: response {previous_id!r} is still {last.status}; continue from it "
                "once it has finished",
                param="previous_response_id",
            )
        return Continuation(items=conversation_items(chain), ancestors=[r.response_id for r in chain])

    async def close(self, timeout_s: float) -> None:
        """End the background runs still going, wait (up to `timeout_s`) until they are
        recorded, and close the store."""
        await self.background.close("the server stopped before this response finished", timeout_s)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)


def conversation_items(chain: Sequence[StoredResponse]) -> list[dict[str, Any]]:
    """Every item of a stored conversation in order: each turn's input, then its output."""
    items: list[dict[str, Any]] = []
    for record in chain:
        items.extend(record.input_items)
        items.extend(output_as_input(record.response.get("output") or []))
    return items


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no response with id {response_id!r} found", code="not_found")
