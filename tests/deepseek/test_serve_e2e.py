"""`deepinfer serve` on a tiny random DeepSeek checkpoint, driven by the real OpenAI and Anthropic SDKs.

The checkpoint's config says deepseek_v3 and it has no chat template, so the server must pick the
V3.2 recipe (DSML family). Each answer is checked against the offline engine fed the V3.2 prompt
and the recipe's parser: same prompt length, same greedy text.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from deepinfer import SamplingParams
from deepinfer.recipe import ModelInfo, Recipe
from deepinfer.recipe.ir import Conversation, Message, TextPart

QUESTION = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server_url(v3_ckpt):
    command = [
        sys.executable, "-m", "deepinfer.cli", "serve", str(v3_ckpt.path), "--port", "0",
        "--num-blocks", "64", "--num-threads", "1", "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines, deadline = None, [], time.monotonic() + 90
    while url is None and time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            break
        lines.append(line)
        if "DeepInfer is serving" in line:
            url = line.split(" at ", 1)[1].split()[0]
    if url is None:
        server.kill()
        pytest.fail("server did not start:\n" + "".join(lines))
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def expected(v3_ckpt, v3_llm):
    """The offline engine on the V3.2 rendering of the question, parsed by the V3.2 parser."""
    recipe = Recipe.for_model(ModelInfo.from_hf_dir(v3_ckpt.path))
    assert recipe.family == "deepseek_v32"
    tokenizer = v3_llm.get_tokenizer()
    conversation = Conversation(messages=[Message(role="user", content=[TextPart(QUESTION)])])
    prompt = recipe.render(conversation, tokenizer=tokenizer.backend)
    assert "<｜User｜>" in prompt.text and prompt.text.rstrip().endswith(
        ("<｜Assistant｜></think>", "<think>")
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, skip_special_tokens=False)
    output = v3_llm.generate([prompt.token_ids], params, use_tqdm=False)[0].outputs[0]
    text = tokenizer.decode(output.token_ids, skip_special_tokens=False)
    finish = "length" if len(output.token_ids) == MAX_TOKENS else "stop"
    return len(prompt.token_ids), prompt.parse_completion(text, finish_reason=finish)


def test_chat_completions_through_the_v32_recipe(server_url, expected):
    import openai

    num_prompt_tokens, parsed = expected
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused")
    request = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    response = client.chat.completions.create(**request)
    assert response.usage.prompt_tokens == num_prompt_tokens
    assert response.choices[0].message.content == parsed.content
    assert response.choices[0].finish_reason == parsed.finish_reason
    streamed = client.chat.completions.create(**request, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == parsed.content


def test_messages_through_the_v32_recipe(server_url, expected):
    import anthropic

    num_prompt_tokens, parsed = expected
    client = anthropic.Anthropic(base_url=server_url, api_key="unused")
    message = client.messages.create(
        model=client.models.list().data[0].id,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},
    )
    assert message.usage.input_tokens == num_prompt_tokens
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == parsed.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[parsed.finish_reason]
