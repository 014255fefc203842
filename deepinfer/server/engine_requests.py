"""An engine request from what a route resolved, and its way into the engine: the cache salt, the
traffic class, where a decode engine pulls the prompt's KV from, admission and submission.

Every route that generates ends here, the prefill half of a disaggregated request included.
"""

from __future__ import annotations

import msgspec
from fastapi import Request

from deepinfer.engine.kv_cache.prefix import tenant_cache_salt
from deepinfer.frontend.client import EngineDeadError, GenerationStream
from deepinfer.image_input import ImageInput
from deepinfer.sampling_params import SamplingParams
from deepinfer.security.signing import handoff_fields
from deepinfer.sequence import EngineRequest, KVSource
from deepinfer.server.errors import ApiError, Flavor, overloaded
from deepinfer.server.peers import check_handoff_signature
from deepinfer.server.state import ServerState
from deepinfer.store.retention import DEFAULT_TRAFFIC_CLASS
from deepinfer.structured.spec import GrammarSpec

TRAFFIC_CLASS_HEADER = "x-traffic-class"
# Set by the router on a request for a decode engine: where the prompt's KV waits.
KV_TRANSFER_HEADER = "x-deepinfer-kv-transfer"
_UNREAD = object()  # a request whose KV_TRANSFER_HEADER was not read yet


class KVTransferHeader(msgspec.Struct):
    """The header's JSON: a direct source (address and transfer id), the store (nothing to pull:
    the decode engine's store connector finds it), or the prefill's failure."""

    address: str | None = None
    transfer_id: str | None = None
    error: str | None = None
    signature: str | None = None  # the router's, with the cluster key (server/peers.py)


_transfer_header = msgspec.json.Decoder(KVTransferHeader)


def engine_request(
    state: ServerState,
    request: Request,
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    *,
    api_key: str | None,
    cache_salt: str | None,
    traffic_class: str | None,
    grammar: GrammarSpec | None = None,
    images: list[ImageInput] | None = None,
) -> EngineRequest:
    """The engine request; a sampling value the engine would refuse is an InvalidRequestError
    (400) here. Marks `request.state` as having read the KV transfer header (see kv_source)."""
    params.validate(state.vocab_size)
    return EngineRequest(
        request_id,
        token_ids,
        params,
        eos_token_ids=list(state.client.info.eos_token_ids),
        cache_salt=scoped_cache_salt(state, api_key, cache_salt),
        traffic_class=chosen_traffic_class(state, request, traffic_class),
        grammar=grammar,
        kv_source=kv_source(state, request),
        images=images or [],
    )


def admit(state: ServerState, flavor: Flavor) -> None:
    """Refuse new work when the engine is dead, the server drains, or too many requests already
    wait; a refusal for load counts in the metrics' `rejected` outcomes."""
    client = state.client
    if client.dead_reason is not None:
        raise ApiError(503, f"the engine is not running: {client.dead_reason}", code="engine_unavailable")
    if state.draining:
        raise ApiError(
            503,
            "the server is shutting down; retry on another replica or after its restart",
            code="server_shutting_down",
            headers={"retry-after": "5"},
        )
    limit = state.config.max_waiting_requests
    if client.num_waiting >= limit:
        state.metrics.count_outcome("rejected")
        raise overloaded(flavor, client.num_waiting, limit)


def submit(
    state: ServerState, requests: list[tuple[EngineRequest, str | None]], arrival: float
) -> GenerationStream:
    """Hand the requests (each with its prompt text, when it has one) to the engine; 503 when it died."""
    try:
        return state.client.submit(requests, arrival)
    except EngineDeadError as error:
        raise ApiError(503, f"the engine is not running: {error}", code="engine_unavailable") from None


def scoped_cache_salt(state: ServerState, api_key: str | None, body_salt: str | None) -> str | None:
    """The body's salt, scoped to the API key unless --shared-prefix-cache: a prefix one key
    cached is then no hit for another, so cached_tokens and timing reveal nothing across keys."""
    if not (state.config.prefix_cache_per_key and api_key):
        return body_salt
    return tenant_cache_salt(api_key, body_salt)


def chosen_traffic_class(state: ServerState, request: Request, body_class: str | None) -> str:
    """The request's traffic class (body field, else header, else the default); 400 when the
    engine keeps no retention for it, so the engine never sees a class it would refuse."""
    header_class = request.headers.get(TRAFFIC_CLASS_HEADER)
    chosen = body_class or header_class or DEFAULT_TRAFFIC_CLASS
    known = state.client.info.traffic_classes
    if chosen not in known:
        where = "traffic_class" if body_class else TRAFFIC_CLASS_HEADER
        raise ApiError(
            400,
            f"{where}: unknown traffic class {chosen!r}; this server keeps {', '.join(known)} "
            "(more with --kv-retention, e.g. batch=12h)",
            param=where,
        )
    return chosen


def kv_source(state: ServerState, request: Request) -> KVSource | None:
    """Where a decode engine pulls the prompt's KV from, per the router's header. A prefill
    that failed is recomputed here, or is an error (kv_transfer_failure=fail). Read once per
    HTTP request and kept on `request.state` (a batch of prompts asks for each): its signature
    is good for one use."""
    source = getattr(request.state, "kv_source", _UNREAD)
    if source is _UNREAD:
        source = request.state.kv_source = _read_kv_source(state, request)
    return source


def _read_kv_source(state: ServerState, request: Request) -> KVSource | None:
    text = request.headers.get(KV_TRANSFER_HEADER)
    if text is None:
        return None
    info = state.client.info
    if info.role != "decode":
        raise ApiError(
            400,
            f"{KV_TRANSFER_HEADER}: this engine's role is {info.role}, not decode",
            param=KV_TRANSFER_HEADER,
        )
    try:
        header = _transfer_header.decode(text)
    except msgspec.DecodeError as error:
        raise ApiError(400, f"{KV_TRANSFER_HEADER}: {error}", param=KV_TRANSFER_HEADER) from None
    # Before acting on any of it: the address is where this engine connects, and what comes
    # back enters the shared prefix cache.
    check_handoff_signature(
        state.cluster_key,
        header.signature,
        handoff_fields(header.transfer_id, header.address, header.error),  # what the router signed
    )
    if header.error is not None:
        if info.kv_transfer_failure == "fail":
            raise ApiError(
                502,
                f"the prefill engine did not hand the prompt off: {header.error}",
                code="kv_transfer_failed",
            )
        return None
    if header.address is None or header.transfer_id is None:
        return None  # through the store: nothing to pull
    return KVSource(header.address, header.transfer_id)
