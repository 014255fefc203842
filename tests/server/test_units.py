"""Server pieces that need no model: IPC messages, and how a request is stamped for the engine."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from deepinfer.config import ConfigError, ServerConfig
from deepinfer.engine.ipc.protocol import (
    AbortRequest,
    AddRequest,
    Codec,
    EngineFailed,
    EngineInfo,
    EngineOutputs,
    EngineReady,
    ResetPrefixCache,
    Shutdown,
    WireRequest,
)
from deepinfer.engine.outputs import SequenceOutput, TokenLogprobs
from deepinfer.engine.stats import EngineStats
from deepinfer.recipe.images.fetch import FetchPolicy
from deepinfer.recipe.ir import ResponseFormat
from deepinfer.sampling_params import InvalidRequestError, SamplingParams
from deepinfer.sequence import EngineRequest
from deepinfer.server.engine_requests import engine_request, scoped_cache_salt
from deepinfer.server.errors import ApiError
from deepinfer.server.generation import grammar_for
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.pipeline import sampling_params
from deepinfer.server.state import ServerState
from deepinfer.structured.spec import GrammarSpec


def test_inputs_round_trip() -> None:
    codec = Codec()
    params = SamplingParams(
        n=3,
        temperature=0.7,
        top_k=5,
        seed=11,
        stop=["END"],
        stop_token_ids=[7],
        max_tokens=9,
        logprobs=2,
        logit_bias={42: -3.5},
        skip_special_tokens=False,
    )
    grammar = GrammarSpec.json(
        {"type": "object", "required": ["a"]}, param="response_format"
    ).with_reasoning()
    request = EngineRequest(
        "req-1",
        [1, 2, 3],
        params,
        eos_token_ids=[2],
        priority=4,
        cache_salt="tenant",
        traffic_class="batch",
        grammar=grammar,
    )
    decoded = codec.decode_input(codec.encode(AddRequest(WireRequest.of(request))))
    assert isinstance(decoded, AddRequest)
    assert decoded.request.to_request() == request
    assert decoded.request.params.logit_bias == {42: -3.5}
    assert decoded.request.grammar == request.grammar
    for message in (AbortRequest("req-1"), AbortRequest("req-1", 2), ResetPrefixCache(), Shutdown()):
        assert codec.decode_input(codec.encode(message)) == message


def test_wire_request_carries_every_engine_request_field() -> None:
    # A field added to EngineRequest must be added to WireRequest too, or it never reaches the engine.
    assert list(WireRequest.__struct_fields__) == [f.name for f in dataclasses.fields(EngineRequest)]


def test_response_formats_become_grammars() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert grammar_for(None, "response_format", thinks=False) is None
    assert grammar_for(ResponseFormat(type="text"), "response_format", thinks=False) is None
    spec = grammar_for(
        ResponseFormat(type="json_schema", json_schema=schema), "response_format", thinks=False
    )
    assert spec is not None and spec.kind == "json" and spec.schema == schema and spec.after_reasoning is None
    spec = grammar_for(ResponseFormat(type="json_object"), "text.format", thinks=True)
    assert spec is not None and spec.kind == "json_object" and spec.after_reasoning == "</think>"
    with pytest.raises(InvalidRequestError) as info:  # a bad shape is a 400 naming the field
        grammar_for(ResponseFormat(type="regex", regex=""), "response_format", thinks=False)
    assert info.value.param == "response_format"


def test_engine_messages_round_trip() -> None:
    codec = Codec()
    stats = EngineStats(1, 2, 300, 364, 5, 80, 32, 0, 4, 1)
    outputs = [
        SequenceOutput("a", 0, [5, 6], num_cached_tokens=16, num_prompt_tokens=30),
        SequenceOutput(
            "b",
            1,
            [9],
            finish_reason="stop",
            stop_reason=7,
            logprobs=[TokenLogprobs(-0.5, 1, [9, 10], [-0.5, -1.5])],
            num_prompt_tokens=4,
        ),
    ]
    for message in (
        EngineOutputs(outputs, stats, True),
        EngineOutputs([], stats),
        EngineReady(EngineInfo("m", 8192, 49152, [2], 364, 16, "fp", ["agent", "chat"], 128, 2048)),
        EngineFailed("boom"),
    ):
        assert codec.decode_message(codec.encode(message)) == message


def _state(**config) -> ServerState:
    # Only `client.info` is read on this path; the engine itself is not involved.
    classes = ["agent", "batch", "chat"]
    client = SimpleNamespace(info=EngineInfo("m", 8192, 100, [2], 10, 16, "fp", classes, 128, 2048))
    return ServerState(ServerConfig(**config), client, None, None, None, ["m"], ServerMetrics(), 0)  # type: ignore[arg-type]


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


@pytest.mark.parametrize(
    ("headers", "body_class", "expected"),
    [
        ({}, None, "chat"),
        ({"x-traffic-class": "batch"}, None, "batch"),
        ({"x-traffic-class": "batch"}, "agent", "agent"),
    ],
)
def test_traffic_class_from_body_header_or_default(
    headers: dict[str, str], body_class, expected: str
) -> None:
    request = engine_request(
        _state(),
        _request(headers),
        "r",
        [1, 2],
        SamplingParams(),
        api_key=None,
        cache_salt=None,
        traffic_class=body_class,
    )
    assert request.traffic_class == expected
    assert request.eos_token_ids == [2]


@pytest.mark.parametrize(
    ("headers", "body_class", "named"),
    [({"x-traffic-class": "nightly"}, None, "x-traffic-class"), ({}, "nightly", "traffic_class")],
)
def test_a_traffic_class_the_engine_does_not_keep_is_a_400(
    headers: dict[str, str], body_class, named: str
) -> None:
    with pytest.raises(ApiError) as info:
        engine_request(
            _state(),
            _request(headers),
            "r",
            [1, 2],
            SamplingParams(),
            api_key=None,
            cache_salt=None,
            traffic_class=body_class,
        )
    assert info.value.status == 400 and info.value.param == named and "nightly" in info.value.message


def test_cache_salt_is_per_key_unless_shared() -> None:
    keys = ("key-a", "key-b")
    shared, isolated = _state(api_keys=keys, shared_prefix_cache=True), _state(api_keys=keys)
    assert scoped_cache_salt(_state(), "key-a", None) is None  # no keys configured: one tenant
    assert scoped_cache_salt(shared, "key-a", None) is None
    assert scoped_cache_salt(shared, "key-a", "s") == "s"
    a, b = scoped_cache_salt(isolated, "key-a", None), scoped_cache_salt(isolated, "key-b", None)
    assert a and b and a != b and "key-a" not in a  # the key itself never becomes a salt
    assert scoped_cache_salt(isolated, "key-a", "s") not in (a, "s")
    assert scoped_cache_salt(isolated, None, "s") == "s"


def test_bad_sampling_values_are_refused_before_the_engine() -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine_request(
            _state(),
            _request({}),
            "r",
            [1],
            SamplingParams(stop_token_ids=[500]),
            api_key=None,
            cache_salt=None,
            traffic_class=None,
        )
    assert info.value.param == "stop_token_ids"


def test_an_unset_output_bound_is_the_servers_then_the_encodings_then_the_context() -> None:
    from deepinfer.recipe.family import PromptDefaults
    from deepinfer.recipe.ir import GenerationParams

    bounded = _state(default_max_tokens=64)
    unbounded = _state()
    encoding = PromptDefaults(max_tokens=300)

    def bound(state: ServerState, requested: int | None, defaults: PromptDefaults | None = None) -> int:
        params = GenerationParams(max_tokens=requested)
        return sampling_params(state, params, 8000, skip_special_tokens=False, defaults=defaults).max_tokens

    assert bound(bounded, None) == 64
    assert bound(bounded, None, encoding) == 64
    assert bound(bounded, 100) == 100
    assert bound(bounded, 1000) == 192  # the context (8192) still caps what the client asks
    assert bound(unbounded, None, encoding) == 192
    assert bound(unbounded, None, PromptDefaults(max_tokens=100)) == 100
    assert bound(unbounded, None) == 192


def test_default_max_tokens_is_checked_with_the_other_options() -> None:
    with pytest.raises(ConfigError, match="default_max_tokens"):
        ServerConfig(default_max_tokens=0)


def test_image_fetching_is_off_unless_configured() -> None:
    assert ServerConfig().image_fetch_policy() == FetchPolicy()
    assert not FetchPolicy().enabled and not FetchPolicy().allow_private
    policy = ServerConfig(
        image_fetch=True, image_fetch_allow_private=True, image_fetch_timeout=2.5
    ).image_fetch_policy()
    assert (policy.enabled, policy.allow_private, policy.timeout_s) == (True, True, 2.5)
    with pytest.raises(ConfigError, match="image_fetch_timeout"):
        ServerConfig(image_fetch_timeout=0)
