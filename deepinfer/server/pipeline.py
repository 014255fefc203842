"""The edge pipeline every generating route runs, whatever its API:

    authorize → read body → model name → (the API's codec: body → conversation) → render →
    images → sampling parameters → output constraint → engine request → admit → submit →
    (the API's codec: events → response or stream)

A route keeps only its codec's two ends: open_call, then prepare (or, for raw Completions
prompts, output_bound and sampling_params through server/completions.py), then submit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from deepinfer.frontend.client import GenerationStream
from deepinfer.image_input import ImageInput
from deepinfer.recipe import Recipe, RenderedPrompt
from deepinfer.recipe.api import new_id
from deepinfer.recipe.encodings import get_encoding
from deepinfer.recipe.family import PromptDefaults
from deepinfer.recipe.ir import Conversation, GenerationParams
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest
from deepinfer.server import engine_requests
from deepinfer.server.constraints import FormatField, output_constraint, parallel_calls_allowed
from deepinfer.server.errors import ApiError, Flavor
from deepinfer.server.generation import ChoiceParsers
from deepinfer.server.generation import sampling_params as engine_sampling_params
from deepinfer.server.http_io import read_json
from deepinfer.server.images import (
    ImageLimits,
    expand_placeholders,
    prepare_images,
    refuse_unfetchable,
)
from deepinfer.server.state import ServerState, state_of
from deepinfer.structured.spec import GrammarSpec
from deepinfer.validation import PromptTooLong, check_context, max_tokens_for


@dataclass(frozen=True, slots=True)
class ChatApi:
    """What differs between the chat-style APIs on the shared path: the body field errors about
    the prompt name, the output-format fields, the id prefix, and the error shape of a refusal."""

    param: str
    fmt: FormatField
    id_prefix: str
    flavor: Flavor


@dataclass(slots=True)
class Call:
    """One HTTP request past the checks every route makes first (see open_call)."""

    request: Request
    state: ServerState
    arrival: float  # time.monotonic() when the route began: the engine's queue time counts from it
    api_key: str | None
    body: Any
    model: str  # the served name the body asks for

    def engine_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None,
        traffic_class: str | None,
        grammar: GrammarSpec | None = None,
        images: list[ImageInput] | None = None,
    ) -> EngineRequest:
        """This call's engine request (server/engine_requests.py), under its key and headers."""
        return engine_requests.engine_request(
            self.state,
            self.request,
            request_id,
            token_ids,
            params,
            api_key=self.api_key,
            cache_salt=cache_salt,
            traffic_class=traffic_class,
            grammar=grammar,
            images=images,
        )

    def admit(self, flavor: Flavor) -> None:
        """503 or 429 when the server takes no new work now (see engine_requests.admit)."""
        engine_requests.admit(self.state, flavor)

    def submit(self, requests: list[tuple[EngineRequest, str | None]]) -> GenerationStream:
        """Start the requests on the engine, queued since this call's arrival."""
        return engine_requests.submit(self.state, requests, self.arrival)


async def open_call(request: Request) -> Call:
    """The first steps of every route that reads a body: authorize (401), read the body (413 or
    400), check the model it names (404), in that order."""
    state = state_of(request)
    arrival = time.monotonic()
    api_key = state.authorize(request)
    body = await read_json(request, state.config.max_body_bytes)
    return Call(request, state, arrival, api_key, body, model_name(state, body))


@dataclass(slots=True)
class Prepared:
    """A chat-style request rendered, bounded, constrained and admitted: what its codec needs to
    answer once `submit` starts it."""

    call: Call
    conv: Conversation
    prompt: RenderedPrompt
    request: EngineRequest

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length, its images' tokens included."""
        assert self.prompt.token_ids is not None
        return len(self.prompt.token_ids)

    def choices(self) -> ChoiceParsers:
        """A parser per sample, turning its deltas into the recipe's events."""
        params = self.conv.params
        top_logprobs = (params.top_logprobs or 0) if params.logprobs else 0
        return ChoiceParsers(self.prompt, self.params.n, top_logprobs)

    def submit(self) -> GenerationStream:
        """Start the request on the engine (with its prompt text, for the engine's logs)."""
        return self.call.submit([(self.request, self.prompt.text)])


async def prepare(call: Call, conv: Conversation, api: ChatApi, *, template_kwargs: Any = None) -> Prepared:
    """The shared steps from a parsed conversation to an admitted engine request: render, place
    images, resolve the sampling parameters (the output bound included), compile the output
    constraint, build the engine request under a new id, admit it. Not yet submitted: a stored
    background response saves its record in between."""
    state = call.state
    prompt = await render(state, conv, template_kwargs, param=api.param)
    assert prompt.token_ids is not None
    images = await place_images(state, prompt, param=api.param, api_key=call.api_key)
    params = sampling_params(
        state,
        conv.params,
        len(prompt.token_ids),
        skip_special_tokens=False,  # the recipe's parser reads (and strips) the model's markers
        defaults=prompt.defaults,
    )
    grammar = await constraint(state, conv, prompt, api.fmt, call.body)
    engine_request = call.engine_request(
        new_id(api.id_prefix),
        prompt.token_ids,
        params,
        cache_salt=conv.cache_salt,
        traffic_class=conv.traffic_class,
        grammar=grammar,
        images=images,
    )
    call.admit(api.flavor)
    return Prepared(call, conv, prompt, engine_request)


# -- the steps ----------------------------------------------------------------------------------


def model_name(state: ServerState, body: Any) -> str:
    """The served name the body asks for (the first one when it names none); 404 otherwise."""
    requested = body.get("model") if isinstance(body, Mapping) else None
    if requested is None or not isinstance(requested, str):
        return state.served_names[0]  # a mistyped `model` is left to the body's validation
    if requested not in state.served_names:
        served = ", ".join(state.served_names)
        raise ApiError(
            404,
            f"the model `{requested}` does not exist; this server serves: {served}",
            param="model",
            code="model_not_found",
        )
    return requested


def require_recipe(state: ServerState) -> Recipe:
    """The model's recipe; 400 when it has none (no chat template, ...)."""
    if state.recipe is None:
        raise ApiError(400, f"chat requests are not available for this model: {state.recipe_error}")
    return state.recipe


def output_bound(
    state: ServerState, requested: int | None, num_prompt_tokens: int, defaults: PromptDefaults | None
) -> int:
    """The request's `max_tokens` for the engine, decided here and nowhere else: the client's,
    else the server's `--default-max-tokens` (the operator's choice), else the prompt encoding's
    default, else the rest of the context; capped by the context left after the prompt."""
    if requested is None:
        server_default = state.config.default_max_tokens
        requested = (
            server_default if server_default is not None else (defaults or PromptDefaults()).max_tokens
        )
    return max_tokens_for(requested, num_prompt_tokens, state.max_model_len)


def sampling_params(
    state: ServerState,
    params: GenerationParams,
    num_prompt_tokens: int,
    *,
    skip_special_tokens: bool,
    defaults: PromptDefaults | None = None,
) -> SamplingParams:
    """The engine's parameters for a request, its output bound resolved by output_bound."""
    return engine_sampling_params(
        params,
        max_tokens=output_bound(state, params.max_tokens, num_prompt_tokens, defaults),
        skip_special_tokens=skip_special_tokens,
        defaults=defaults,
    )


async def render(
    state: ServerState, conv: Conversation, template_kwargs: Any = None, *, param: str
) -> RenderedPrompt:
    """The prompt, rendered and tokenized on a thread: a long one takes seconds, and the
    tokenizer releases the GIL, so the event loop answers other requests meanwhile."""
    return await asyncio.to_thread(_render, state, conv, template_kwargs, param)


def _render(state: ServerState, conv: Conversation, template_kwargs: Any, param: str) -> RenderedPrompt:
    kwargs = template_kwargs if isinstance(template_kwargs, Mapping) else None
    max_model_len = state.max_model_len
    try:
        prompt = require_recipe(state).render(
            conv,
            tokenizer=state.tokenizer.backend,
            template_kwargs=kwargs,
            max_tokens=max_model_len - 1,  # the prompt's bound (the output needs one token at least)
        )
    except PromptTooLong as error:  # images would only add tokens
        check_context(error.num_tokens, max_model_len, param)
        raise
    assert prompt.token_ids is not None
    if prompt.images and (not state.client.info.accepts_images or state.image_pool is None):
        where = prompt.images[0].path or param
        raise ApiError(
            400, f"{where}: this model does not accept images (it has no vision tower)", param=where
        )
    check_context(len(prompt.token_ids), max_model_len, param)
    return prompt


async def counted_tokens(state: ServerState, prompt: RenderedPrompt, *, param: str) -> list[int]:
    """The prompt's ids as a request sends them (/tokenize, count_tokens): each image's
    placeholder expanded to its tokens when the model takes images (mutates `prompt.token_ids`)."""
    if prompt.images and state.image_pool is not None and state.client.info.accepts_images:
        await place_images(state, prompt, param=param, for_engine=False)
    return prompt.token_ids or []


async def place_images(
    state: ServerState,
    prompt: RenderedPrompt,
    *,
    param: str,
    for_engine: bool = True,
    api_key: str | None = None,
) -> list[ImageInput]:
    """Preprocess the prompt's images off the event loop and expand each placeholder in
    `prompt.token_ids` to its image's tokens (so every later count sees them); the images
    for the engine, placed. With --encoder and `for_engine`, an encoder preprocesses and
    encodes them (a counting request only needs the local preprocessing), under the
    client's `api_key` (encoders take the engines' keys). A bad image is a 400 naming its
    part; no encoder answering, a 503."""
    if not prompt.images:
        return []
    assert prompt.token_ids is not None and state.image_pool is not None  # render checked both
    # The token the prompt's own encoding gives each image (V4.1's `<｜image｜>`).
    spelling = get_encoding(prompt.family).image_placeholder
    placeholder = state.tokenizer.token_to_id(spelling) if spelling is not None else None
    if placeholder is None:
        raise ApiError(400, f"{param}: the tokenizer has no {spelling or 'image'} token", param=param)
    config = state.config
    limits = ImageLimits(config.max_images_per_request, config.image_max_pixels)
    if for_engine and state.encoders is not None:
        limits.check_count(prompt.images)
        refuse_unfetchable(prompt.images, config.image_fetch_policy())
        images = await state.encoders.encode(prompt.images, api_key)
    else:
        images = await prepare_images(state.image_pool, prompt.images, config.image_fetch_policy(), limits)
    prompt.token_ids, placed = expand_placeholders(prompt.token_ids, images, placeholder, param, spelling)
    check_context(len(prompt.token_ids), state.max_model_len, param)
    return placed


async def constraint(
    state: ServerState, conv: Conversation, prompt: RenderedPrompt, fmt: FormatField, body: Mapping[str, Any]
) -> GrammarSpec | None:
    """The request's response format or forced tool call as a grammar, compiled once here so
    that a schema that cannot be enforced is a 400 before anything streams."""
    if state.grammars is None:
        raise RuntimeError("the server state has no grammar validator (start_state builds one)")
    spec = output_constraint(
        conv,
        prompt,
        fmt,
        parallel_calls=parallel_calls_allowed(body),
        special_tokens=state.grammars.special_tokens,
        additional_properties=state.config.json_schema_additional_properties,
    )
    await state.grammars.check(spec)
    return spec
