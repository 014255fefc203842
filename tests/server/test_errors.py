"""Every error answers with the right status and in the shape of the API the client speaks."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import ADMIN_KEY, API_KEY, MAX_BODY_BYTES, MODEL

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
GOOD_MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def openai_error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def anthropic_error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
def test_malformed_json_openai(http: httpx.Client, path: str) -> None:
    reply = http.post(
        path, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}
    )
    error = openai_error(reply, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == "body"
    assert "invalid JSON" in error["message"]


def test_malformed_json_anthropic(http: httpx.Client) -> None:
    reply = http.post(MESSAGES, content=b"{nope", headers={"content-type": "application/json"})
    error = anthropic_error(reply, 400)
    assert error["type"] == "invalid_request_error" and "invalid JSON" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),  # missing
        ({**GOOD_CHAT, "messages": "Hi"}, "messages"),  # mistyped
        ({**GOOD_CHAT, "temperature": "hot"}, "temperature"),  # mistyped
        ({**GOOD_CHAT, "temperature": 3.5}, "temperature"),  # out of range
        ({**GOOD_CHAT, "n": 0}, "n"),
        ({**GOOD_CHAT, "max_tokens": 0}, "max_tokens"),
        ({**GOOD_CHAT, "top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
        ({**GOOD_CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
        ({**GOOD_CHAT, "stop": [""]}, "stop[0]"),
    ],
)
def test_bad_chat_fields_name_the_param(http: httpx.Client, body: dict, param: str) -> None:
    error = openai_error(http.post(CHAT, json=body), 400)
    assert error["param"] == param, error
    assert param.split("[")[0] in error["message"]


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    reply = http.post(CHAT, json={**GOOD_CHAT, "some_future_field": {"x": 1}, "service_tier": "auto"})
    assert reply.status_code == 200, reply.text
    reply = http.post(MESSAGES, json={**GOOD_MESSAGES, "speed": "fast", "container": None})
    assert reply.status_code == 200, reply.text


def test_bad_messages_fields(http: httpx.Client) -> None:
    body = dict(GOOD_MESSAGES)
    del body["max_tokens"]
    assert "max_tokens" in anthropic_error(http.post(MESSAGES, json=body), 400)["message"]
    bad = {**GOOD_MESSAGES, "stop_sequences": "END"}
    assert "stop_sequences" in anthropic_error(http.post(MESSAGES, json=bad), 400)["message"]


def test_completions_refuses_echo(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "echo": True})
    assert openai_error(reply, 400)["param"] == "echo"


def test_context_length_overflow(http: httpx.Client) -> None:
    long_text = "hello " * 9000  # more tokens than the model's 8192-token context
    error = openai_error(
        http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "user", "content": long_text}]}), 400
    )
    assert error["param"] == "messages" and "context length" in error["message"]
    error = openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": long_text}), 400)
    assert error["param"] == "prompt" and "context length" in error["message"]
    reply = http.post(MESSAGES, json={**GOOD_MESSAGES, "messages": [{"role": "user", "content": long_text}]})
    assert "context length" in anthropic_error(reply, 400)["message"]


def test_unknown_model(http: httpx.Client, oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    error = openai_error(http.post(CHAT, json={**GOOD_CHAT, "model": "gpt-nope"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-nope" in error["message"]
    assert (
        anthropic_error(http.post(MESSAGES, json={**GOOD_MESSAGES, "model": "claude-nope"}), 404)["type"]
        == "not_found_error"
    )
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-nope", messages=GOOD_CHAT["messages"], max_tokens=1)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", messages=GOOD_MESSAGES["messages"], max_tokens=1)


def test_api_key_required(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
            assert openai_error(anonymous.post(CHAT, json=GOOD_CHAT, headers=headers), 401)["type"] == (
                "authentication_error"
            )
        for headers in ({}, {"x-api-key": "wrong"}):
            error = anthropic_error(anonymous.post(MESSAGES, json=GOOD_MESSAGES, headers=headers), 401)
            assert error["type"] == "authentication_error"
        # The Anthropic header works on every route, and /health needs no key.
        assert anonymous.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert anonymous.get("/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=GOOD_MESSAGES["messages"], max_tokens=1
        )


def test_body_too_large(http: httpx.Client) -> None:
    big = "x" * (MAX_BODY_BYTES + 1000)
    reply = http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "user", "content": big}]})
    assert openai_error(reply, 413)["type"] == "invalid_request_error"
    reply = http.post(MESSAGES, json={**GOOD_MESSAGES, "messages": [{"role": "user", "content": big}]})
    assert anthropic_error(reply, 413)["type"] == "request_too_large"


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert openai_error(http.post("/v1/nothing", json={}), 404)["type"] == "not_found_error"
    assert openai_error(http.get(CHAT), 405)
    assert anthropic_error(http.get(MESSAGES), 405)


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello world"
    error = openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert error["param"] == "tokens[0]"


def test_reset_prefix_cache_when_idle(http: httpx.Client) -> None:
    reply = http.post("/reset_prefix_cache", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert reply.status_code == 200 and reply.json() == {"reset": True}
    # An operator route: every tenant's cache goes, so a tenant's API key is not enough.
    assert openai_error(http.post("/reset_prefix_cache"), 401)["code"] == "invalid_api_key"
    assert openai_error(httpx.post(str(http.base_url.join("/reset_prefix_cache"))), 401)


def test_an_unknown_traffic_class_is_a_400_and_the_engine_serves_on(http: httpx.Client) -> None:
    """Once, such a request stopped the engine for everyone (with a store); now the edge refuses it."""
    prompt = {"model": MODEL, "prompt": "word " * 300, "max_tokens": 1}
    reply = http.post("/v1/completions", json=prompt, headers={"x-traffic-class": "batch"})
    assert openai_error(reply, 400)["param"] == "x-traffic-class"
    reply = http.post(MESSAGES, json={**GOOD_MESSAGES, "traffic_class": "batch"})
    assert "traffic_class" in anthropic_error(reply, 400)["message"]
    assert http.get("/health").status_code == 200
    assert http.post(CHAT, json=GOOD_CHAT, headers={"x-traffic-class": "agent"}).status_code == 200
