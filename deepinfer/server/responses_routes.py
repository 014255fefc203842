"""The Responses API: create (stateless, stored or background), retrieve, resume a background
response's stream, list its input items, delete, cancel.

With a response store (the default), `store: true` (the API's default) keeps the response and
its input items under the caller's API key; `store: false` keeps nothing. Another key's id is a
404, as is an id that expired or was evicted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.recipe.api import ResponsesEncoder, parse_responses_request, request_to_conversation
from deepinfer.recipe.api.responses import ResponsesRequest, response_echo, wants_encrypted_reasoning
from deepinfer.recipe.api.responses_items import input_item_resources
from deepinfer.recipe.ir import Conversation
from deepinfer.response_store import ACTIVE_STATUSES, StoredResponse, tenant_of
from deepinfer.server.answer import respond
from deepinfer.server.constraints import RESPONSES_FORMAT
from deepinfer.server.errors import ApiError
from deepinfer.server.http_io import EventStreamResponse
from deepinfer.server.pipeline import ChatApi, open_call, prepare
from deepinfer.server.sinks import ResponsesSink
from deepinfer.server.state import ServerState, state_of
from deepinfer.server.stored_responses import Continuation

log = logging.getLogger(__name__)

router = APIRouter()

MAX_LIST_LIMIT = 100


RESPONSES = ChatApi(param="input", fmt=RESPONSES_FORMAT, id_prefix="resp_", flavor="openai")


@dataclass(slots=True)
class ResponsesInput:
    """A Responses body, checked, with the earlier turns its `previous_response_id` names: what
    both a request and /tokenize render."""

    parsed: ResponsesRequest
    conv: Conversation
    continuation: Continuation


async def responses_input(state: ServerState, body: Any, tenant: str) -> ResponsesInput:
    """Validate a body and bring in the conversation its `previous_response_id` names."""
    responses = state.responses
    parsed = await asyncio.to_thread(parse_responses_request, body, stored=responses.enabled)
    continuation = await responses.continuation(tenant, parsed.previous_response_id)
    conv = request_to_conversation(parsed, state.responses_options, continuation.items)
    return ResponsesInput(parsed, conv, continuation)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    call = await open_call(request)
    state = call.state
    tenant = tenant_of(call.api_key)
    given = await responses_input(state, call.body, tenant)
    parsed, conv = given.parsed, given.conv
    prepared = await prepare(call, conv, RESPONSES)
    response_id = prepared.request_id
    responses = state.responses
    keep = responses.enabled and parsed.store is not False
    background = bool(parsed.background)
    encoder = ResponsesEncoder(
        response_id=response_id,
        model=call.model,
        created_at=int(time.time()),
        echo=response_echo(parsed, stored=keep),
        stream=conv.stream or background,  # a background run records its events for resuming
        tools=conv.tools,
        seal_reasoning=state.reasoning_sealer.seal if wants_encrypted_reasoning(parsed) else None,
        queued=background,
    )
    choices = prepared.choices()
    record = StoredResponse(
        response_id=response_id,
        tenant=tenant,
        response={},
        input_items=input_item_resources(parsed.input, response_id.removeprefix("resp_")),
        ancestors=given.continuation.ancestors,
        traffic_class=prepared.request.traffic_class,
        background=background,
        done=not background,
    )
    if background:
        opening = encoder.start()
        record.response = encoder.snapshot("queued")
        await responses.save(record, opening)  # before the engine starts: a store that is down is a 503
        stream = prepared.submit()
        responses.background.start(tenant, response_id, stream, choices, encoder)
        if conv.stream:
            # The client follows the run; leaving does not stop it.
            return EventStreamResponse(responses.background.follow(tenant, response_id, -1), lambda: None)
        return JSONResponse(record.response)
    stream = prepared.submit()

    async def save() -> None:
        assert encoder.result is not None
        record.response = encoder.result
        await responses.save(record)

    return await respond(
        request,
        stream,
        choices,
        ResponsesSink(encoder),
        streaming=conv.stream,
        on_close=save if keep else None,
    )


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    """The response object; with `stream=true`, a background response's events after
    `starting_after` (all of them by default), then its live ones until it ends."""
    state = state_of(request)
    tenant = tenant_of(state.authorize(request))
    query = request.query_params
    streaming = _bool_query(query.get("stream"), "stream")
    record = await state.responses.get(tenant, response_id)
    if not streaming:
        return JSONResponse(record.response)
    if not record.background:
        raise ApiError(
            400,
            "stream: only a background response (`background: true`) can be streamed again",
            param="stream",
        )
    after = _int_query(query.get("starting_after"), "starting_after", default=-1, minimum=-1)
    return EventStreamResponse(state.responses.background.follow(tenant, response_id, after), lambda: None)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> JSONResponse:
    """The items the request of a response added (not the earlier turns'), newest first by
    default; `limit` (1..100, default 20), `order` (asc | desc), `after` (an item id)."""
    state = state_of(request)
    tenant = tenant_of(state.authorize(request))
    query = request.query_params
    limit = _int_query(query.get("limit"), "limit", default=20, minimum=1, maximum=MAX_LIST_LIMIT)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: expected asc or desc, got {order!r}", param="order")
    record = await state.responses.get(tenant, response_id)
    items = record.input_items if order == "asc" else record.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    """Remove a response, its input items and its events (a background run still going stops
    at its next write)."""
    state = state_of(request)
    tenant = tenant_of(state.authorize(request))
    await state.responses.delete(tenant, response_id)
    if state.responses.background.is_local(tenant, response_id):
        await state.responses.background.stop_local(tenant, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> JSONResponse:
    """Stop a background response that is queued or in progress; one that has ended is
    returned as it is."""
    state = state_of(request)
    tenant = tenant_of(state.authorize(request))
    responses = state.responses
    record = await responses.get(tenant, response_id)
    if not record.background:
        raise ApiError(
            400, f"response {response_id!r} was not created with `background: true`: it cannot be cancelled"
        )
    if record.status in ACTIVE_STATUSES:
        store = responses.store
        assert store is not None
        await responses.call(store.cancel, tenant, response_id, record.response)
        await responses.background.stop_local(tenant, response_id)
        record = await responses.get(tenant, response_id)
    return JSONResponse(record.response)


def _bool_query(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("false", "0"):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise ApiError(400, f"{name}: expected true or false, got {value!r}", param=name)


def _int_query(
    value: str | None, name: str, *, default: int, minimum: int, maximum: int | None = None
) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ApiError(400, f"{name}: expected an integer, got {value!r}", param=name) from None
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ApiError(400, f"{name}: must be {bound}, got {number}", param=name)
    return number
