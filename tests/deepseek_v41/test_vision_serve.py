"""Images over `deepinfer serve` on a tiny DeepSeek-V4.1 with a vision tower (V4.1's tokenizer).

Each API's image part reaches the model: the server preprocesses it in its worker processes,
expands the prompt's placeholder to the image's tokens (usage counts them) and the engine puts
the tower's embeddings there. Greedy output does not depend on the batch; a second turn with the
same image hits the prefix cache over the image's blocks, a different image never does. Bad
images are 400s in the API's shape naming the part, and the server keeps serving; a text-only
checkpoint refuses images the same way.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from deepinfer.recipe.images.source import prepare_image
from deepinfer.recipe.ir import ImagePart
from tests.deepseek.tiny_checkpoint import write_tokenizer
from tests.deepseek_v41.tiny_v41 import build_v41
from tests.deepseek_v41.vision_inputs import png_base64, vision_config
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow
deepseek_reference = pytest.importorskip("tests.recipe.deepseek_reference")

BLOCK = 8
MODEL = "tiny-v41"


def _serve(path, *options: str) -> ServerProcess:
    return ServerProcess(
        str(path), "--num-threads", "1", "--block-size", str(BLOCK), "--served-model-name", MODEL, *options
    ).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_vision_serve")
    vocab = write_tokenizer(path, deepseek_reference.tokenizer_json("deepseek_v41"))
    build_v41(path, vision_config(vocab_size=vocab, max_position_embeddings=2048), seed=21)
    process = _serve(path, "--image-workers", "2", "--max-body-bytes", "64MiB")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def text_only_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_text_only")
    vocab = write_tokenizer(path, deepseek_reference.tokenizer_json("deepseek_v41"))
    build_v41(path, vision_config(vocab_size=vocab, max_position_embeddings=2048), seed=21, vision=False)
    process = _serve(path)
    yield process
    process.stop()


def _data_url(b64: str) -> str:
    return "data:image/png;base64," + b64


def _chat(image_b64: str, text: str = "What is this?") -> dict:
    content = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": _data_url(image_b64)}},
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,  # honoured with thinking off (V4.1's thinking mode forces 1.0)
        "reasoning_effort": "none",
        "thinking": {"type": "disabled"},
    }


def _image_tokens(image_b64: str) -> int:
    return prepare_image(ImagePart(url=_data_url(image_b64))).num_tokens


def _post(server: ServerProcess, path: str, body: dict):
    with server.client() as http:
        return http.post(path, json=body)


def _answer(server: ServerProcess, body: dict) -> dict:
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_image_url_counts_the_images_tokens(server) -> None:
    image = png_base64(1)
    body = _chat(image)
    tokens = _post(server, "/tokenize", body).json()["tokens"]  # as the engine gets them
    start, count = tokens.index(_placeholder(server)), _image_tokens(image)
    assert tokens[start : start + count] == [tokens[start]] * count
    assert tokens[start + count] != tokens[start]
    answer = _answer(server, body)
    assert answer["usage"]["prompt_tokens"] == len(tokens)
    assert answer["usage"]["completion_tokens"] >= 1


def test_responses_input_image(server) -> None:
    image = png_base64(2)
    content = [
        {"type": "input_text", "text": "Describe"},
        {"type": "input_image", "image_url": _data_url(image)},
    ]
    body = {"model": MODEL, "input": [{"role": "user", "content": content}], "max_output_tokens": 6}
    response = _post(server, "/v1/responses", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] > _image_tokens(image)


def test_messages_base64_image(server) -> None:
    image = png_base64(3)
    source = {"type": "base64", "media_type": "image/png", "data": image}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "Describe"}]
    body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": content}]}
    counted = _post(server, "/v1/messages/count_tokens", body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > _image_tokens(image)
    response = _post(server, "/v1/messages", body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (
        usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) == counted.json()["input_tokens"]
    )


def _message(server: ServerProcess, body: dict) -> dict:
    return _answer(server, body)["choices"][0]["message"]


def test_greedy_output_alone_and_batched_is_the_same(server) -> None:
    bodies = [_chat(png_base64(10), "Describe"), _chat(png_base64(11), "Describe")]
    alone = [_message(server, body) for body in bodies]
    with ThreadPoolExecutor(2) as pool:
        batched = list(pool.map(lambda body: _message(server, body), bodies))
    assert batched == alone
    assert alone[0] != alone[1]  # the same text: each answer comes from its own picture


def test_the_same_image_next_turn_is_a_prefix_hit_and_another_is_not(server) -> None:
    first, other = png_base64(20), png_base64(21)
    turn = _chat(first, "A picture for a cache test")
    reply = _answer(server, turn)["choices"][0]["message"]["content"]
    tokenized = _post(server, "/tokenize", turn).json()["tokens"]
    placeholder = tokenized.index(_placeholder(server))
    image_end = placeholder + _image_tokens(first)

    def second_turn(image: str) -> dict:
        body = _chat(image, "A picture for a cache test")
        body["messages"] += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And now?"}]
        return body

    same = _answer(server, second_turn(first))["usage"]
    assert same["prompt_tokens_details"]["cached_tokens"] >= image_end // BLOCK * BLOCK
    different = _answer(server, second_turn(other))["usage"]
    assert different["prompt_tokens_details"]["cached_tokens"] <= placeholder // BLOCK * BLOCK


def _placeholder(server: ServerProcess) -> int:
    body = {"model": MODEL, "prompt": "<｜image｜>"}
    return _post(server, "/tokenize", body).json()["tokens"][-1]


def _png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


BAD_IMAGES = {
    "truncated": png_base64(4)[:40],
    "not an image": base64.b64encode(b"just some text, no picture at all").decode(),
    "1x100000": _png(1, 100000),
    "over 32 MiB": "A" * (44 << 20),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_are_400s_naming_the_part(server, case) -> None:
    image = BAD_IMAGES[case]
    response = _post(server, "/v1/chat/completions", _chat(image))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # the part, or its field when the parser caught it (the size limit)
    assert error["param"].startswith("messages[0].content[1]") and error["type"] == "invalid_request_error"

    source = {"type": "base64", "media_type": "image/png", "data": image}
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }
    response = _post(server, "/v1/messages", body)
    assert response.status_code == 400, response.text
    assert (
        response.json()["type"] == "error" and "messages[0].content[0]" in response.json()["error"]["message"]
    )

    assert _answer(server, _chat(png_base64(1)))["choices"]  # still serving


def test_an_image_url_is_not_fetched_unless_allowed(server) -> None:
    body = _chat("")
    body["messages"][0]["content"][1]["image_url"]["url"] = "http://127.0.0.1:9/picture.png"
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "does not fetch" in error["message"]


def test_a_model_without_a_vision_tower_refuses_images_naming_the_part(text_only_server) -> None:
    response = _post(text_only_server, "/v1/chat/completions", _chat(png_base64(1)))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content[1]"
    assert "vision" in response.json()["error"]["message"]
    text = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert _answer(text_only_server, text)["choices"]
