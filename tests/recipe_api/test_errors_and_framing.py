"""Error bodies read by the real SDKs, SSE framing, and the recipe's torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import anthropic
import openai
import pytest
from anthropic.types.shared import ErrorResponse

from deepinfer.recipe.api import (
    anthropic_error_body,
    anthropic_error_from,
    chat_completion_to_conversation,
    openai_error_body,
    openai_error_from,
    sse_frame,
)
from deepinfer.recipe.errors import RecipeError
from tests.recipe_api.harness import Recorder, anthropic_client, decode_sse, json_response, openai_client

OPENAI_EXCEPTIONS = {
    400: openai.BadRequestError,
    401: openai.AuthenticationError,
    404: openai.NotFoundError,
    413: openai.APIStatusError,
    429: openai.RateLimitError,
    500: openai.InternalServerError,
}
ANTHROPIC_EXCEPTIONS = {
    400: (anthropic.BadRequestError, "invalid_request_error"),
    401: (anthropic.AuthenticationError, "authentication_error"),
    404: (anthropic.NotFoundError, "not_found_error"),
    413: (anthropic.APIStatusError, "request_too_large"),
    429: (anthropic.RateLimitError, "rate_limit_error"),
    500: (anthropic.InternalServerError, "api_error"),
    529: (anthropic.APIStatusError, "overloaded_error"),
}


def test_recipe_error_becomes_an_openai_400_the_sdk_understands() -> None:
    with pytest.raises(RecipeError) as caught:
        chat_completion_to_conversation({"messages": [{"role": "user", "content": "x"}], "temperature": 9})
    body = openai_error_from(caught.value)
    client = openai_client(Recorder(lambda _: json_response(body, status=400)))
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert raised.value.param == "temperature"
    assert raised.value.type == "invalid_request_error"
    assert "temperature" in raised.value.message


@pytest.mark.parametrize("status", sorted(OPENAI_EXCEPTIONS))
def test_openai_error_bodies_by_status(status: int) -> None:
    body = openai_error_body("nope", status=status, code="c1")
    assert set(body["error"]) == {"message", "type", "param", "code"}
    client = openai_client(Recorder(lambda _: json_response(body, status=status)))
    with pytest.raises(OPENAI_EXCEPTIONS[status]) as raised:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == status
    assert raised.value.code == "c1"


@pytest.mark.parametrize("status", sorted(ANTHROPIC_EXCEPTIONS))
def test_anthropic_error_bodies_by_status(status: int) -> None:
    exception, error_type = ANTHROPIC_EXCEPTIONS[status]
    body = anthropic_error_body("nope", status=status)
    assert body == {"type": "error", "error": {"type": error_type, "message": "nope"}}
    if error_type != "request_too_large":  # that one comes from Anthropic's proxy, not in the SDK union
        ErrorResponse.model_validate(body)
    client = anthropic_client(Recorder(lambda _: json_response(body, status=status)))
    with pytest.raises(exception) as raised:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == status
    assert raised.value.body == body


def test_anthropic_error_from_recipe_error() -> None:
    body = anthropic_error_from(RecipeError("max_tokens: Field required", param="max_tokens"))
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }


def test_sse_frames_round_trip_through_the_sdk_decoder() -> None:
    frames = [sse_frame({"a": "é\nb"}), sse_frame({"type": "ping"}, event="ping"), "data: [DONE]\n\n"]
    assert frames[0] == 'data: {"a":"é\\nb"}\n\n'
    assert frames[1] == 'event: ping\ndata: {"type":"ping"}\n\n'
    decoded = decode_sse(frames)
    assert decoded == [(None, '{"a":"é\\nb"}'), ("ping", '{"type":"ping"}'), (None, "[DONE]")]
    assert json.loads(decoded[0][1]) == {"a": "é\nb"}


def test_recipe_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import deepinfer.recipe, deepinfer.recipe.api\n"
        "from deepinfer.recipe.api import chat_completions, responses, messages\n"
        "print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
