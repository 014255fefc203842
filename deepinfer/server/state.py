"""What every route needs: options, the engine client, the tokenizer and recipe, and the checks
that come before generation (API key, model name, backpressure, prompt size)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request

from deepinfer.config import ServerConfig
from deepinfer.engine.ipc.client import EngineClient, EngineDeadError, GenerationStream
from deepinfer.engine.kv_cache.prefix import tenant_cache_salt
from deepinfer.image_input import ImageInput
from deepinfer.recipe import Recipe, RenderedPrompt
from deepinfer.recipe.api.responses import ResponsesOptions
from deepinfer.recipe.api.responses_reasoning import ReasoningSealer
from deepinfer.recipe.family import PromptDefaults
from deepinfer.recipe.ir import Conversation, GenerationParams
from deepinfer.sampling_params import SamplingParams
from deepinfer.security.signing import handoff_fields
from deepinfer.sequence import EngineRequest, KVSource
from deepinfer.server.auth import check_admin_key, check_api_key, is_admin
from deepinfer.server.constraints import (
    FormatField,
    GrammarValidator,
    output_constraint,
    parallel_calls_allowed,
)
from deepinfer.server.encoders import EncoderClient
from deepinfer.server.errors import ApiError, Flavor, overloaded
from deepinfer.server.generation import sampling_params
from deepinfer.server.images import (
    IMAGE_PLACEHOLDER,
    ImageLimits,
    expand_placeholders,
    prepare_images,
    refuse_unfetchable,
)
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.peers import check_handoff_signature
from deepinfer.server.stored_responses import StoredResponses
from deepinfer.store.retention import DEFAULT_TRAFFIC_CLASS
from deepinfer.structured.spec import GrammarSpec
from deepinfer.tokenizer import Tokenizer
from deepinfer.validation import PromptTooLong, check_context

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


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    client: EngineClient
    tokenizer: Tokenizer
    recipe: Recipe | None
    recipe_error: str | None  # why there is no recipe (no chat template, ...)
    served_names: list[str]
    metrics: ServerMetrics
    created: int
    grammars: GrammarValidator | None = None  # built by start_state; needed by constrained requests
    draining: bool = False  # a graceful stop began: new requests get 503, those in flight finish
    reasoning_sealer: ReasoningSealer = field(default_factory=ReasoningSealer.generate)
    responses: StoredResponses = field(default_factory=lambda: StoredResponses(None))  # None: keeps nothing
    image_pool: ProcessPoolExecutor | None = None  # image preprocessing (a model with a vision tower)
    encoders: EncoderClient | None = None  # --encoder: image encoders that preprocess and encode images
    cluster_key: bytes | None = None  # --cluster-key-file: what peers prove they hold (server/peers.py)

    @property
    def responses_options(self) -> ResponsesOptions:
        return ResponsesOptions(hosted_tools=self.config.hosted_tools, reasoning=self.reasoning_sealer)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size

    # -- checks before any work ----------------------------------------------------------------

    def authorize(self, request: Request) -> str | None:
        """The API key the client used; 401 when keys are required and it is missing or wrong."""
        return check_api_key(self.config.api_keys, request.headers)

    def authorize_admin(self, request: Request, what: str, alternative: str = "") -> None:
        """The admin routes' check (server/auth.py, shared with the router)."""
        check_admin_key(self.config.api_keys, self.config.admin_keys, request.headers, what, alternative)

    def is_admin(self, request: Request) -> bool:
        """Whether the request may see internal details (engine pid, why it died)."""
        return is_admin(self.config.api_keys, self.config.admin_keys, request.headers)

    def model_name(self, body: Any) -> str:
        """The served name the body asks for (the first one when it names none); 404 otherwise."""
        requested = body.get("model") if isinstance(body, Mapping) else None
        if requested is None or not isinstance(requested, str):
            return self.served_names[0]  # a mistyped `model` is left to the body's validation
        if requested not in self.served_names:
            served = ", ".join(self.served_names)
            raise ApiError(
                404,
                f"the model `{requested}` does not exist; this server serves: {served}",
                param="model",
                code="model_not_found",
            )
        return requested

    def admit(self, flavor: Flavor) -> None:
        """Refuse new work when the engine is dead or too many requests already wait."""
        client = self.client
        if client.dead_reason is not None:
            raise ApiError(503, f"the engine is not running: {client.dead_reason}", code="engine_unavailable")
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down; retry on another replica or after its restart",
                code="server_shutting_down",
                headers={"retry-after": "5"},
            )
        limit = self.config.max_waiting_requests
        if client.num_waiting >= limit:
            self.metrics.count_outcome("rejected")
            raise overloaded(flavor, client.num_waiting, limit)

    def require_recipe(self) -> Recipe:
        if self.recipe is None:
            raise ApiError(400, f"chat requests are not available for this model: {self.recipe_error}")
        return self.recipe

    # -- building requests ---------------------------------------------------------------------

    def sampling_params(
        self,
        params: GenerationParams,
        num_prompt_tokens: int,
        *,
        skip_special_tokens: bool,
        defaults: PromptDefaults | None = None,
    ) -> SamplingParams:
        """The engine's parameters for a request, bounded by this server's context length and
        `--default-max-tokens` (see generation.sampling_params)."""
        return sampling_params(
            params,
            num_prompt_tokens=num_prompt_tokens,
            max_model_len=self.max_model_len,
            skip_special_tokens=skip_special_tokens,
            defaults=defaults,
            default_max_tokens=self.config.default_max_tokens,
        )

    async def render(self, conv: Conversation, template_kwargs: Any = None, *, param: str) -> RenderedPrompt:
        """The prompt, rendered and tokenized on a thread: a long one takes seconds, and the
        tokenizer releases the GIL, so the event loop answers other requests meanwhile."""
        return await asyncio.to_thread(self._render, conv, template_kwargs, param)

    def _render(self, conv: Conversation, template_kwargs: Any, param: str) -> RenderedPrompt:
        kwargs = template_kwargs if isinstance(template_kwargs, Mapping) else None
        try:
            prompt = self.require_recipe().render(
                conv,
                tokenizer=self.tokenizer.backend,
                template_kwargs=kwargs,
                max_tokens=self.max_model_len - 1,
            )
        except PromptTooLong as error:  # images would only add tokens
            check_context(error.num_tokens, self.max_model_len, param)
            raise
        assert prompt.token_ids is not None
        if prompt.images and (not self.client.info.accepts_images or self.image_pool is None):
            where = prompt.images[0].path or param
            raise ApiError(
                400, f"{where}: this model does not accept images (it has no vision tower)", param=where
            )
        check_context(len(prompt.token_ids), self.max_model_len, param)
        return prompt

    async def counted_tokens(self, prompt: RenderedPrompt, *, param: str) -> list[int]:
        """The prompt's ids as a request sends them (/tokenize, count_tokens): each image's
        placeholder expanded to its tokens when the model takes images."""
        if prompt.images and self.image_pool is not None and self.client.info.accepts_images:
            await self.place_images(prompt, param=param, for_engine=False)
        return prompt.token_ids or []

    async def place_images(
        self, prompt: RenderedPrompt, *, param: str, for_engine: bool = True, api_key: str | None = None
    ) -> list[ImageInput]:
        """Preprocess the prompt's images off the event loop and expand each placeholder in
        `prompt.token_ids` to its image's tokens (so every later count sees them); the images
        for the engine, placed. With --encoder and `for_engine`, an encoder preprocesses and
        encodes them (a counting request only needs the local preprocessing), under the
        client's `api_key` (encoders take the engines' keys). A bad image is a 400 naming its
        part; no encoder answering, a 503."""
        if not prompt.images:
            return []
        assert prompt.token_ids is not None and self.image_pool is not None  # render checked both
        placeholder = self.tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        if placeholder is None:
            raise ApiError(400, f"{param}: the tokenizer has no {IMAGE_PLACEHOLDER} token", param=param)
        limits = ImageLimits(self.config.max_images_per_request, self.config.image_max_pixels)
        if for_engine and self.encoders is not None:
            limits.check_count(prompt.images)
            refuse_unfetchable(prompt.images, self.config.image_fetch_policy())
            images = await self.encoders.encode(prompt.images, api_key)
        else:
            images = await prepare_images(
                self.image_pool, prompt.images, self.config.image_fetch_policy(), limits
            )
        prompt.token_ids, placed = expand_placeholders(prompt.token_ids, images, placeholder, param)
        check_context(len(prompt.token_ids), self.max_model_len, param)
        return placed

    async def output_constraint(
        self, conv: Conversation, prompt: RenderedPrompt, fmt: FormatField, body: Mapping[str, Any]
    ) -> GrammarSpec | None:
        """The request's response format or forced tool call as a grammar, compiled once here so
        that a schema that cannot be enforced is a 400 before anything streams."""
        if self.grammars is None:
            raise RuntimeError("the server state has no grammar validator (start_state builds one)")
        spec = output_constraint(
            conv,
            prompt,
            fmt,
            parallel_calls=parallel_calls_allowed(body),
            special_tokens=self.grammars.special_tokens,
            additional_properties=self.config.json_schema_additional_properties,
        )
        await self.grammars.check(spec)
        return spec

    def cache_salt(self, api_key: str | None, body_salt: str | None) -> str | None:
        """The body's salt, scoped to the API key unless --shared-prefix-cache: a prefix one key
        cached is then no hit for another, so cached_tokens and timing reveal nothing across keys."""
        if not (self.config.prefix_cache_per_key and api_key):
            return body_salt
        return tenant_cache_salt(api_key, body_salt)

    def kv_source(self, request: Request) -> KVSource | None:
        """Where a decode engine pulls the prompt's KV from, per the router's header. A prefill
        that failed is recomputed here, or is an error (kv_transfer_failure=fail). Read once per
        HTTP request (a batch of prompts asks for each): its signature is good for one use."""
        source = getattr(request.state, "kv_source", _UNREAD)
        if source is _UNREAD:
            source = request.state.kv_source = self._kv_source(request)
        return source

    def _kv_source(self, request: Request) -> KVSource | None:
        text = request.headers.get(KV_TRANSFER_HEADER)
        if text is None:
            return None
        info = self.client.info
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
            self.cluster_key,
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

    def engine_request(
        self,
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
        params.validate(self.vocab_size)
        return EngineRequest(
            request_id,
            token_ids,
            params,
            eos_token_ids=list(self.client.info.eos_token_ids),
            cache_salt=self.cache_salt(api_key, cache_salt),
            traffic_class=self.traffic_class(request, traffic_class),
            grammar=grammar,
            kv_source=self.kv_source(request),
            images=images or [],
        )

    def traffic_class(self, request: Request, body_class: str | None) -> str:
        """The request's traffic class (body field, else header, else the default); 400 when the
        engine keeps no retention for it, so the engine never sees a class it would refuse."""
        header_class = request.headers.get(TRAFFIC_CLASS_HEADER)
        chosen = body_class or header_class or DEFAULT_TRAFFIC_CLASS
        known = self.client.info.traffic_classes
        if chosen not in known:
            where = "traffic_class" if body_class else TRAFFIC_CLASS_HEADER
            raise ApiError(
                400,
                f"{where}: unknown traffic class {chosen!r}; this server keeps {', '.join(known)} "
                "(more with --kv-retention, e.g. batch=12h)",
                param=where,
            )
        return chosen

    def submit(self, requests: list[tuple[EngineRequest, str | None]], arrival: float) -> GenerationStream:
        try:
            return self.client.submit(requests, arrival)
        except EngineDeadError as error:
            raise ApiError(503, f"the engine is not running: {error}", code="engine_unavailable") from None
