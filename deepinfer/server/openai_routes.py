"""OpenAI-compatible routes: Chat Completions, Completions and the model list (the Responses API
is responses_routes.py)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.recipe.api import (
    ChatCompletionEncoder,
    chat_completion_to_conversation,
    new_id,
)
from deepinfer.recipe.ir import Conversation
from deepinfer.server.answer import respond
from deepinfer.server.completions import CompletionEncoder, TextChoices, parse_completion_request
from deepinfer.server.constraints import CHAT_FORMAT
from deepinfer.server.generation import ChoiceParsers
from deepinfer.server.http_io import read_json
from deepinfer.server.sinks import ChatSink
from deepinfer.server.state import ServerState
from deepinfer.validation import PromptTooLong, check_context, check_prompt

router = APIRouter()


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def _top_logprobs(conv: Conversation) -> int:
    return (conv.params.top_logprobs or 0) if conv.params.logprobs else 0


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    arrival = time.monotonic()
    api_key = state.authorize(request)
    body = await read_json(request, state.config.max_body_bytes)
    model = state.model_name(body)
    conv = await asyncio.to_thread(chat_completion_to_conversation, body)
    prompt = await state.render(conv, body.get("chat_template_kwargs"), param="messages")
    assert prompt.token_ids is not None
    images = await state.place_images(prompt, param="messages", api_key=api_key)
    params = state.sampling_params(
        conv.params,
        len(prompt.token_ids),
        skip_special_tokens=False,  # the recipe's parser reads (and strips) the model's markers
        defaults=prompt.defaults,
    )
    grammar = await state.output_constraint(conv, prompt, CHAT_FORMAT, body)
    request_id = new_id("chatcmpl-")
    engine_request = state.engine_request(
        request,
        request_id,
        prompt.token_ids,
        params,
        api_key=api_key,
        cache_salt=conv.cache_salt,
        traffic_class=conv.traffic_class,
        grammar=grammar,
        images=images,
    )
    state.admit("openai")
    stream = state.submit([(engine_request, prompt.text)], arrival)
    encoder = ChatCompletionEncoder(
        completion_id=request_id,
        model=model,
        created=int(time.time()),
        n=params.n,
        include_usage=conv.include_usage,
        stream=conv.stream,
    )
    choices = ChoiceParsers(prompt, params.n, _top_logprobs(conv))
    return await respond(request, stream, choices, ChatSink(encoder), streaming=conv.stream)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
    arrival = time.monotonic()
    api_key = state.authorize(request)
    body = await read_json(request, state.config.max_body_bytes)
    model = state.model_name(body)
    parsed = await asyncio.to_thread(parse_completion_request, body)
    completion_id = new_id("cmpl-")
    engine_requests = []
    for i, prompt in enumerate(parsed.prompts):
        where = "prompt" if len(parsed.prompts) == 1 else f"prompt[{i}]"
        text = prompt if isinstance(prompt, str) else None
        token_ids = await asyncio.to_thread(_prompt_ids, state, prompt, where)
        params = state.sampling_params(
            parsed.params,
            len(token_ids),
            skip_special_tokens=True,
        )
        request_id = completion_id if len(parsed.prompts) == 1 else f"{completion_id}-{i}"
        engine_requests.append(
            (
                state.engine_request(
                    request,
                    request_id,
                    token_ids,
                    params,
                    api_key=api_key,
                    cache_salt=parsed.cache_salt,
                    traffic_class=parsed.traffic_class,
                ),
                text,
            )
        )
    state.admit("openai")
    stream = state.submit(engine_requests, arrival)
    n = parsed.params.n
    encoder = CompletionEncoder(
        completion_id=completion_id,
        model=model,
        created=int(time.time()),
        num_choices=len(engine_requests) * n,
        n=n,
        include_usage=parsed.include_usage,
        stream=parsed.stream,
    )
    choices = TextChoices([r.request_id for r, _ in engine_requests], n, parsed.params.top_logprobs or 0)
    return await respond(request, stream, choices, encoder, streaming=parsed.stream)


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


def _prompt_ids(state: ServerState, prompt: str | list[int], where: str) -> list[int]:
    """A Completions prompt's ids, checked (on a thread: a long one takes seconds either way)."""
    if isinstance(prompt, str):
        try:
            token_ids = state.tokenizer.encode(prompt, max_tokens=state.max_model_len - 1)
        except PromptTooLong as error:
            check_context(error.num_tokens, state.max_model_len, where)
            raise
    else:
        token_ids = prompt
    check_prompt(token_ids, state.vocab_size, state.max_model_len, where)
    return token_ids


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
    name = state.model_name({"model": model})
    return JSONResponse(_model_card(name, state.created, state.max_model_len))
