"""Anthropic-compatible routes: Messages and count_tokens (errors in Anthropic's shape)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.recipe.api import (
    count_tokens_body,
    count_tokens_to_conversation,
    messages_to_conversation,
    new_id,
)
from deepinfer.server.answer import respond
from deepinfer.server.constraints import MESSAGES_FORMAT
from deepinfer.server.generation import ChoiceParsers
from deepinfer.server.http_io import read_json
from deepinfer.server.openai_routes import state_of
from deepinfer.server.sinks import MessagesSink

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    state = state_of(request)
    arrival = time.monotonic()
    api_key = state.authorize(request)
    body = await read_json(request, state.config.max_body_bytes)
    model = state.model_name(body)
    conv = await asyncio.to_thread(messages_to_conversation, body)
    prompt = await state.render(conv, param="messages")
    assert prompt.token_ids is not None
    images = await state.place_images(prompt, param="messages", api_key=api_key)
    params = state.sampling_params(
        conv.params,
        len(prompt.token_ids),
        skip_special_tokens=False,
        defaults=prompt.defaults,
    )
    grammar = await state.output_constraint(conv, prompt, MESSAGES_FORMAT, body)
    message_id = new_id("msg_")
    engine_request = state.engine_request(
        request,
        message_id,
        prompt.token_ids,
        params,
        api_key=api_key,
        cache_salt=conv.cache_salt,
        traffic_class=conv.traffic_class,
        grammar=grammar,
        images=images,
    )
    state.admit("anthropic")
    stream = state.submit([(engine_request, prompt.text)], arrival)
    sink = MessagesSink(
        message_id=message_id, model=model, prompt_tokens=len(prompt.token_ids), stream=conv.stream
    )
    return await respond(request, stream, ChoiceParsers(prompt, 1, 0), sink, streaming=conv.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    state = state_of(request)
    state.authorize(request)
    body = await read_json(request, state.config.max_body_bytes)
    state.model_name(body)
    conv = await asyncio.to_thread(count_tokens_to_conversation, body)
    recipe = state.require_recipe()
    prompt = await asyncio.to_thread(recipe.render, conv, tokenizer=state.tokenizer.backend)
    return JSONResponse(count_tokens_body(len(await state.counted_tokens(prompt, param="messages"))))
