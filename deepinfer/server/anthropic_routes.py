"""Anthropic-compatible routes: Messages and count_tokens (errors in Anthropic's shape). The
shared path is server/pipeline.py; this file holds the Messages codec's two ends."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.recipe.api import count_tokens_body, count_tokens_to_conversation, messages_to_conversation
from deepinfer.server.answer import respond
from deepinfer.server.constraints import MESSAGES_FORMAT
from deepinfer.server.pipeline import ChatApi, counted_tokens, open_call, prepare, require_recipe
from deepinfer.server.sinks import MessagesSink

router = APIRouter()

MESSAGES = ChatApi(param="messages", fmt=MESSAGES_FORMAT, id_prefix="msg_", flavor="anthropic")


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    call = await open_call(request)
    conv = await asyncio.to_thread(messages_to_conversation, call.body)
    prepared = await prepare(call, conv, MESSAGES)
    stream = prepared.submit()
    sink = MessagesSink(
        message_id=prepared.request_id,
        model=call.model,
        prompt_tokens=prepared.num_prompt_tokens,
        stream=conv.stream,
    )
    return await respond(request, stream, prepared.choices(), sink, streaming=conv.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    call = await open_call(request)
    state = call.state
    conv = await asyncio.to_thread(count_tokens_to_conversation, call.body)
    recipe = require_recipe(state)
    prompt = await asyncio.to_thread(recipe.render, conv, tokenizer=state.tokenizer.backend)
    return JSONResponse(count_tokens_body(len(await counted_tokens(state, prompt, param="messages"))))
