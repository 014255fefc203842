"""Operational routes: health, Prometheus metrics, tokenize / detokenize, prefix-cache reset."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer.frontend.client import EngineDeadError
from deepinfer.recipe.api import chat_completion_to_conversation
from deepinfer.recipe.api._validation import ApiModel, require, validate
from deepinfer.response_store import tenant_of
from deepinfer.server.errors import ApiError
from deepinfer.server.pipeline import counted_tokens, open_call, render, require_recipe
from deepinfer.server.responses_routes import responses_input
from deepinfer.server.state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Keyless (load balancers probe it); the engine's pid and why it died only for an admin
    key, or on a server without keys: they describe the machine, not the service."""
    state = state_of(request)
    client = state.client
    detail: dict[str, Any] = {}
    if state.is_admin(request):
        detail["engine"] = {"pid": client.transport.engine_pid}
        if client.dead_reason is not None:
            detail["reason"] = client.dead_reason
    if client.dead_reason is not None:
        return JSONResponse({"status": "unhealthy", **detail}, 503)
    if state.draining:
        return JSONResponse({"status": "draining", **detail}, 503, headers={"retry-after": "5"})
    return JSONResponse({"status": "ok", **detail})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Behind the admin key once keys are set (--public-metrics opens it): its prefix-cache
    counters would tell one tenant about another's traffic."""
    state = state_of(request)
    if not state.config.public_metrics:
        state.authorize_admin(request, "/metrics", " (or --public-metrics to serve it without a key)")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _TokenizePrompt(ApiModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class _Detokenize(ApiModel):
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    """`{"prompt": text}` tokenizes text; `{"messages": [...], ...}` (a Chat Completions body)
    or `{"input": ..., ...}` (a Responses body, `previous_response_id` included) tokenizes the
    prompt the chat template renders for it, exactly as a request would."""
    call = await open_call(request)
    state, body = call.state, call.body
    if isinstance(body, dict) and "input" in body:
        given = await responses_input(state, body, tenant_of(call.api_key))
        prompt = await render(state, given.conv, param="input")
        tokens = await counted_tokens(state, prompt, param="input")
    elif isinstance(body, dict) and "messages" in body:
        conv = await asyncio.to_thread(chat_completion_to_conversation, body)
        kwargs = body.get("chat_template_kwargs")
        prompt = await asyncio.to_thread(
            require_recipe(state).render,
            conv,
            tokenizer=state.tokenizer.backend,
            template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        )
        tokens: list[int] = await counted_tokens(state, prompt, param="messages")
    else:
        parsed = validate(_TokenizePrompt, body)
        tokens = await asyncio.to_thread(state.tokenizer.encode, parsed.prompt, parsed.add_special_tokens)
    answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    # A prompt of megabytes is millions of ids: encoded on a thread, off the event loop.
    return Response(await asyncio.to_thread(msgspec.json.encode, answer), media_type="application/json")


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    call = await open_call(request)
    state = call.state
    parsed = validate(_Detokenize, call.body)
    for i, token_id in enumerate(parsed.tokens):
        require(
            0 <= token_id < state.vocab_size,
            f"token id {token_id} is outside the vocabulary [0, {state.vocab_size})",
            f"tokens[{i}]",
        )
    return JSONResponse({"prompt": state.tokenizer.decode(parsed.tokens, skip_special_tokens=False)})


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """Forget every cached prefix; refused (409) while requests hold blocks. Admin only: the
    reset is the engine's whole cache, every tenant's, whatever their salts."""
    state = state_of(request)
    state.authorize_admin(request, "/reset_prefix_cache")
    try:
        done = await state.client.reset_prefix_cache()
    except EngineDeadError as error:
        raise ApiError(503, f"the engine is not running: {error}", code="engine_unavailable") from None
    if not done:
        raise ApiError(409, "the prefix cache can only be reset while no request holds KV blocks")
    result: dict[str, Any] = {"reset": True}
    return JSONResponse(result)
