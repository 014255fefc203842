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

from deepinfer.recipe import RenderedPrompt
from deepinfer.recipe.api import ResponsesEncoder, new_id, parse_responses_request, request_to_conversation
from deepinfer.recipe.api.responses import ResponsesRequest, response_echo, wants_encrypted_reasoning
from deepinfer.recipe.api.responses_items import input_item_resources
from deepinfer.recipe.ir import Conversation
from deepinfer.response_store import ACTIVE_STATUSES, StoredResponse, tenant_of
from deepinfer.server.answer import respond
from deepinfer.server.constraints import RESPONSES_FORMAT
from deepinfer.server.errors import ApiError
from deepinfer.server.generation import ChoiceParsers
from deepinfer.server.http_io import EventStreamResponse, read_json
from deepinfer.server.sinks import ResponsesSink
from deepinfer.server.state import ServerState
from deepinfer.server.stored_responses import Continuation

log = logging.getLogger(__name__)

router = APIRouter()

MAX_LIST_LIMIT = 100


def state_of(request: Request) -> ServerState:
    return request.app.state.server


@dataclass(slots=True)
class ResponsesPrompt:
    """A Responses body, checked and rendered: what both a request and /tokenize need."""

    parsed: ResponsesRequest
    conv: Conversation
    prompt: RenderedPrompt
    continuation: Continuation


async def responses_prompt(state: ServerState, body: Any, tenant: str) -> ResponsesPrompt:
    """Validate a body, bring in the conversation its `previous_response_id` names, render it."""
    responses = state.responses
    parsed = await asyncio.to_thread(parse_responses_request, body, stored=responses.enabled)
    continuation = await responses.continuation(tenant, parsed.previous_response_id)
    conv = request_to_conversation(parsed, state.responses_options, continuation.items)
    prompt = await state.render(conv, param="input")
    return ResponsesPrompt(parsed, conv, prompt, continuation)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = state_of(request)
    arrival = time.monotonic()
    api_key = state.authorize(request)
    tenant = tenant_of(api_key)
    body = await read_json(request, state.config.max_body_bytes)
    model = state.model_name(body)
    rendered = await responses_prompt(state, body, tenant)
    parsed, conv, prompt = rendered.parsed, rendered.conv, rendered.prompt
    assert prompt.token_ids is not None
    images = await state.place_images(prompt, param="input", api_key=api_key)
    responses = state.responses
    keep = responses.enabled and parsed.store is not False
    background = bool(parsed.background)
    params = state.sampling_params(
        conv.params,
        len(prompt.token_ids),
        skip_special_tokens=False,
        defaults=prompt.defaults,
    )
    grammar = await state.output_constraint(conv, prompt, RESPONSES_FORMAT, body)
    response_id = new_id("resp_")
    engine_request = state.engine_request(
        request,
        response_id,
        prompt.token_ids,
        params,
        api_key=api_key,
        cache_salt=conv.cache_salt,
        traffic_class=conv.traffic_class,
        grammar=grammar,
        images=images,
    )
    state.admit("openai")
    encoder = ResponsesEncoder(
        response_id=response_id,
        model=model,
        created_at=int(time.time()),
        echo=response_echo(parsed, stored=keep),
        stream=conv.stream or background,  # a background run records its events for resuming
        tools=conv.tools,
        seal_reasoning=state.reasoning_sealer.seal if wants_encrypted_reasoning(parsed) else None,
        queued=background,
    )
    choices = ChoiceParsers(prompt, 1, (conv.params.top_logprobs or 0) if conv.params.logprobs else 0)
    record = StoredResponse(
        response_id=response_id,
        tenant=tenant,
        response={},
        input_items=input_item_resources(parsed.input, response_id.removeprefix("resp_")),
        ancestors=rendered.continuation.ancestors,
        traffic_class=engine_request.traffic_class,
        background=background,
        done=not background,
    )
    if background:
        opening = encoder.start()
        record.response = encoder.snapshot("queued")
        await responses.save(record, opening)  # before the engine starts: a store that is down is a 503
        stream = state.submit([(engine_request, prompt.text)], arrival)
        responses.background.start(tenant, response_id, stream, choices, encoder)
        if conv.stream:
            # The client follows the run; leaving does not stop it.
            return EventStreamResponse(responses.background.follow(tenant, response_id, -1), lambda: None)
        return JSONResponse(record.response)
    stream = state.submit([(engine_request, prompt.text)], arrival)

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
