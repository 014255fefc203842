"""OpenAI-compatible routes: Chat Completions, Completions and the model list (the Responses API
is responses_routes.py). The shared path is server/pipeline.py; this file holds the two codecs'
ends."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.recipe.api import (
    ChatCompletionEncoder,
    chat_completion_to_conversation,
    new_id,
    parse_completion_request,
)
from deepinfer.server.answer import respond
from deepinfer.server.completions import CompletionSink, TextChoices, completion_requests
from deepinfer.server.constraints import CHAT_FORMAT
from deepinfer.server.pipeline import ChatApi, model_name, open_call, prepare
from deepinfer.server.sinks import ChatSink
from deepinfer.server.state import state_of

router = APIRouter()

CHAT = ChatApi(param="messages", fmt=CHAT_FORMAT, id_prefix="chatcmpl-", flavor="openai")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    call = await open_call(request)
    conv = await asyncio.to_thread(chat_completion_to_conversation, call.body)
    prepared = await prepare(call, conv, CHAT, template_kwargs=call.body.get("chat_template_kwargs"))
    stream = prepared.submit()
    encoder = ChatCompletionEncoder(
        completion_id=prepared.request_id,
        model=call.model,
        created=int(time.time()),
        n=prepared.params.n,
        include_usage=conv.include_usage,
        stream=conv.stream,
    )
    return await respond(request, stream, prepared.choices(), ChatSink(encoder), streaming=conv.stream)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    call = await open_call(request)
    parsed = await asyncio.to_thread(parse_completion_request, call.body)
    completion_id = new_id("cmpl-")
    engine_requests = await completion_requests(call, parsed, completion_id)
    call.admit("openai")
    stream = call.submit(engine_requests)
    n = parsed.params.n
    sink = CompletionSink(
        completion_id=completion_id,
        model=call.model,
        created=int(time.time()),
        num_choices=len(engine_requests) * n,
        n=n,
        include_usage=parsed.include_usage,
        stream=parsed.stream,
    )
    choices = TextChoices([r.request_id for r, _ in engine_requests], n, parsed.params.top_logprobs or 0)
    return await respond(request, stream, choices, sink, streaming=parsed.stream)


def _model_card(name: str, created: int, max_model_len: int) -> dict[str, object]:
    # One object that both SDKs accept: OpenAI's model fields and Anthropic's ModelInfo fields.
    return {
        "id": name,
        "object": "model",
        "type": "model",
        "created": created,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        "display_name": name,
        "lifecycle": "active",
        "owned_by": "deepinfer",
        "max_model_len": max_model_len,
        "max_input_tokens": max_model_len,
        "max_tokens": max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = state_of(request)
    state.authorize(request)
    cards = [_model_card(name, state.created, state.max_model_len) for name in state.served_names]
    return JSONResponse(
        {
            "object": "list",
            "data": cards,
            "has_more": False,
            "first_id": cards[0]["id"],
            "last_id": cards[-1]["id"],
        }
    )


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> JSONResponse:
    state = state_of(request)
    state.authorize(request)
    name = model_name(state, {"model": model})
    return JSONResponse(_model_card(name, state.created, state.max_model_len))
