"""Routes a router uses: what an engine is (role, hash root, where its KV events and transfers
are) with its load, and the prefill half of a disaggregated request.

`POST /v1/pd/prefill` (prefill role) takes prompt token ids the router rendered, runs them for one
token with the KV handed off under the router's transfer id, and answers once the KV is ready for
the decode engine: leased on the transfer listener (direct) or written to the shared store.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.engine.outputs import KVHandoff
from deepinfer.frontend.client import EngineDeadError, GenerationStream
from deepinfer.recipe.api._validation import ApiModel, validate
from deepinfer.sampling_params import SamplingParams
from deepinfer.security import CLUSTER_KEY_FLAG
from deepinfer.server.auth import key_of, matching_key
from deepinfer.server.engine_requests import admit, engine_request, submit
from deepinfer.server.errors import ApiError
from deepinfer.server.http_io import read_json, until_disconnect
from deepinfer.server.peers import require_peer
from deepinfer.server.state import state_of
from deepinfer.store.retention import DEFAULT_TRAFFIC_CLASS
from deepinfer.validation import check_prompt

router = APIRouter()

# Beyond the prefill itself: how long the handoff may take to be ready (store writes).
HANDOFF_GRACE_S = 60.0


@router.get("/v1/engine_info")
async def engine_info(request: Request) -> JSONResponse:
    """Routers poll it as their health check. It names internal addresses (the transfer
    listener, the events socket): peers and admins only with a cluster key, API key holders
    on a keyless (loopback-only) deployment."""
    state = state_of(request)
    if state.cluster_key is not None:
        if matching_key(state.config.admin_keys, key_of(request.headers)) is None:
            require_peer(state.cluster_key, request, "GET /v1/engine_info")
    else:
        state.authorize(request)
    client = state.client
    stats = client.stats
    load = None
    if stats is not None:
        load = {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_free_blocks": stats.num_free_blocks,
            "num_blocks": stats.num_blocks,
            "prefix_hit_rate": stats.prefix_hit_rate,
        }
    body = {
        **{name: getattr(client.info, name) for name in client.info.__struct_fields__},
        "served_model_names": state.served_names,
        "cache_salt_per_key": state.config.prefix_cache_per_key,
        "healthy": client.healthy and not state.draining,  # a draining server takes no new work
        "draining": state.draining,
        "api_waiting_requests": client.num_waiting,
        "load": load,
    }
    return JSONResponse(body, status_code=200 if body["healthy"] else 503)


class _PrefillBody(ApiModel):
    transfer_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    traffic_class: str | None = None
    priority: int = 0


@router.post("/v1/pd/prefill")
async def prefill(request: Request) -> JSONResponse:
    state = state_of(request)
    arrival = time.monotonic()
    api_key = state.authorize(request)
    # The router's own call: a tenant calling it would choose transfer ids and salts.
    if state.cluster_key is None:
        raise ApiError(
            403,
            f"POST /v1/pd/prefill: this engine has no {CLUSTER_KEY_FLAG}, so it cannot tell the "
            "router from a client; start it (and the router) with one",
            code="peer_auth_failed",
        )
    require_peer(state.cluster_key, request, "POST /v1/pd/prefill")
    info = state.client.info
    if info.role != "prefill":
        raise ApiError(404, f"POST /v1/pd/prefill: this engine's role is {info.role}, not prefill")
    body = validate(_PrefillBody, await read_json(request, state.config.max_body_bytes))
    if not body.transfer_id:
        raise ApiError(400, "transfer_id: must not be empty", param="transfer_id")
    check_prompt(body.prompt_token_ids, state.vocab_size, state.max_model_len, "prompt_token_ids")
    if body.traffic_class is not None and body.traffic_class not in info.traffic_classes:
        raise ApiError(
            400,
            f"traffic_class: {body.traffic_class!r} is not one of {info.traffic_classes}",
            param="traffic_class",
        )
    prefill_request = engine_request(
        state,
        request,
        body.transfer_id,
        body.prompt_token_ids,
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        api_key=api_key,
        cache_salt=body.cache_salt,
        traffic_class=body.traffic_class or DEFAULT_TRAFFIC_CLASS,
    )
    prefill_request.priority = body.priority
    prefill_request.kv_handoff = body.transfer_id
    admit(state, "openai")
    try:
        ready = state.client.expect_handoff(body.transfer_id)
    except EngineDeadError as error:
        raise ApiError(503, f"the engine is not running: {error}", code="engine_unavailable") from None
    stream = submit(state, [(prefill_request, None)], arrival)
    outcome = await until_disconnect(request, _prefilled(stream, ready), stream.abort)
    if outcome is None:
        ready.cancel()
        raise ApiError(499, "the client went away")
    return JSONResponse({**outcome, "kv_transfer": info.kv_transfer, "address": info.kv_transfer_address})


async def _prefilled(stream: GenerationStream, ready: asyncio.Future[KVHandoff]) -> dict[str, object]:
    """Wait for the one-token prefill to end, then for its handoff."""
    finish = None
    cached = 0
    try:
        async for batch in stream.batches():
            for delta in batch:
                cached = delta.num_cached_tokens
                if delta.finish_reason is not None:
                    finish = delta
    except EngineDeadError as error:
        ready.cancel()
        raise ApiError(503, f"the engine is not running: {error}", code="engine_unavailable") from None
    if finish is None or finish.finish_reason not in ("stop", "length"):
        ready.cancel()
        reason = (finish.error if finish is not None else None) or "the prefill did not finish"
        raise ApiError(500, f"the prefill failed: {reason}", code="prefill_failed")
    try:
        handoff = await asyncio.wait_for(ready, HANDOFF_GRACE_S)
    except TimeoutError:
        raise ApiError(504, "the prompt's KV was not ready in time", code="prefill_failed") from None
    except EngineDeadError as error:
        raise ApiError(503, f"the engine is not running: {error}", code="engine_unavailable") from None
    if handoff.error is not None:
        raise ApiError(500, f"the prefill failed: {handoff.error}", code="prefill_failed")
    return {
        "transfer_id": handoff.transfer_id,
        "num_blocks": handoff.num_blocks,
        "num_tokens": handoff.num_tokens,
        "num_cached_tokens": cached,
        "num_prompt_tokens": finish.num_prompt_tokens,
    }
