"""`deepinfer serve --role encode` with real processes on loopback: a tiny DeepSeek-V4.1 with a
vision tower served by an encoder and a `both` engine pointed at it (`--encoder`), against one
`both` process that encodes its images itself.

Greedy output is the same either way, over two APIs; a second turn with the same image reports
its blocks cached, and its embeddings are not pulled again (the engine's encoder-output cache has
them: the lease is released unread). With the encoder gone, an image request is a 503 in the
API's shape naming it; with embeddings that cannot be pulled (an encoder whose leases end at
once), a 500 saying so; text requests are still served and no KV block stays in use.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.deepseek.tiny_checkpoint import write_tokenizer
from tests.deepseek_v41.tiny_v41 import build_v41
from tests.deepseek_v41.vision_inputs import png_base64, vision_config
from tests.pd.cluster import blocks_in_use, start_all
from tests.server.server_process import AnnouncedProcess, ServerProcess, metric_value, wait_until

pytestmark = pytest.mark.slow
deepseek_reference = pytest.importorskip("tests.recipe.deepseek_reference")

BLOCK = 8
MODEL = "tiny-v41"
_ENCODER = re.compile(r"DeepInfer encoder is serving .* at (http://\S+) ")


class EncoderProcess(AnnouncedProcess):
    def __init__(self, path: str, *options: str) -> None:
        command = ["serve", path, "--role", "encode", "--num-threads", "1", "--log-level", "warning"]
        super().__init__([*command, *(options or ("--port", "0"))], _ENCODER, 300.0)


def _engine(path: str, *options: str) -> ServerProcess:
    return ServerProcess(
        path, "--num-threads", "1", "--block-size", str(BLOCK), "--served-model-name", MODEL, *options
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_encode_role")
    vocab = write_tokenizer(path, deepseek_reference.tokenizer_json("deepseek_v41"))
    build_v41(path, vision_config(vocab_size=vocab, max_position_embeddings=2048), seed=21)
    # The encoder would fetch URLs (even private ones): the engine's own policy (off) must hold.
    encoder = EncoderProcess(str(path), "--port", "0", "--image-fetch", "--image-fetch-allow-private").start()
    pair = _engine(str(path), "--encoder", encoder.url)
    alone = _engine(str(path))
    try:
        start_all([pair, alone])
        yield {"encoder": encoder, "pair": pair, "alone": alone, "path": str(path)}
    finally:
        for process in (pair, alone, encoder):
            process.kill()


def _image(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(seed)}}


def _chat(*messages: dict) -> dict:
    return {
        "model": MODEL,
        "messages": list(messages),
        "max_tokens": 6,
        "temperature": 0,
        "reasoning_effort": "none",
        "thinking": {"type": "disabled"},
    }


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    with server.client() as http:
        return http.post(path, json=body)


def _ok(server: ServerProcess, path: str, body: dict) -> dict:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _metric(url: str, name: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, name)


def test_chat_with_an_image_is_the_same_as_one_process_and_a_second_turn_is_cached(servers) -> None:
    pair, alone, encoder = servers["pair"], servers["alone"], servers["encoder"]
    first = _chat({"role": "user", "content": [{"type": "text", "text": "What is this?"}, _image(1)]})
    expected = _ok(alone, "/v1/chat/completions", first)
    got = _ok(pair, "/v1/chat/completions", first)
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    # the encoder encoded it and the engine pulled it; the engine's tower ran on nothing
    assert _metric(encoder.url, "deepinfer_encoder_images_encoded_total") == 1
    assert _metric(encoder.url, "deepinfer_encoder_images_served_total") == 1
    assert _metric(pair.url, "deepinfer_images_encoded_total") == 0

    reply = got["choices"][0]["message"]["content"]
    second = _chat(
        *first["messages"], {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}
    )
    expected = _ok(alone, "/v1/chat/completions", second)
    got = _ok(pair, "/v1/chat/completions", second)
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    image_tokens = got["usage"]["prompt_tokens"] - 20  # the image is most of the prompt
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_tokens // BLOCK * BLOCK
    assert _metric(encoder.url, "deepinfer_encoder_images_encoded_total") == 1  # the encoder's cache
    assert _metric(encoder.url, "deepinfer_encoder_images_served_total") == 1  # not pulled again
    assert wait_until(lambda: _metric(encoder.url, "deepinfer_encoder_leases_active") == 0, 10)


def test_messages_with_images_are_the_same_as_one_process(servers) -> None:
    pair, alone = servers["pair"], servers["alone"]
    source = {"type": "base64", "media_type": "image/png", "data": png_base64(3)}
    twice = {"type": "base64", "media_type": "image/png", "data": png_base64(4)}
    content = [
        {"type": "image", "source": source},
        {"type": "image", "source": twice},
        {"type": "text", "text": "Both?"},
    ]
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": content}],
    }
    expected, got = _ok(alone, "/v1/messages", body), _ok(pair, "/v1/messages", body)
    assert got["content"] == expected["content"] and got["usage"] == expected["usage"]
    counted = _ok(pair, "/v1/messages/count_tokens", body)["input_tokens"]  # counted without encoding
    assert counted == expected["usage"]["input_tokens"] + (
        expected["usage"].get("cache_read_input_tokens") or 0
    )


def test_a_bad_image_is_the_encoders_400_naming_the_part(servers) -> None:
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(5)[:40]}}
    response = _post(servers["pair"], "/v1/chat/completions", _chat({"role": "user", "content": [bad]}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("messages[0].content[0]")


def test_a_url_image_is_refused_before_the_encoder_when_this_server_does_not_fetch(servers) -> None:
    pair, encoder = servers["pair"], servers["encoder"]
    asked = _metric(encoder.url, "deepinfer_encoder_images_requested_total")
    url = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    response = _post(pair, "/v1/chat/completions", _chat({"role": "user", "content": [url]}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content[0]"
    assert "does not fetch image URLs" in response.json()["error"]["message"]
    assert _metric(encoder.url, "deepinfer_encoder_images_requested_total") == asked


def test_with_the_encoder_gone_images_are_503s_and_text_is_served(servers) -> None:
    pair, encoder = servers["pair"], servers["encoder"]
    encoder.kill()
    body = _chat({"role": "user", "content": [{"type": "text", "text": "What is this?"}, _image(6)]})
    response = _post(pair, "/v1/chat/completions", body)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    # The encoder's address is internal: the log has it, the client's error does not.
    assert error["code"] == "encoder_unavailable" and encoder.url not in error["message"]
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64(6)}}
    ]
    response = _post(
        pair,
        "/v1/messages",
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]},
    )
    assert response.status_code == 503 and response.json()["type"] == "error", response.text
    text = _chat({"role": "user", "content": "Hello"})
    assert _ok(pair, "/v1/chat/completions", text)["choices"][0]["message"]["content"]
    assert wait_until(lambda: blocks_in_use(pair) == 0, 10)


def test_embeddings_that_cannot_be_pulled_fail_the_request_alone(servers) -> None:
    pair, port = servers["pair"], servers["encoder"].url.rsplit(":", 1)[1]
    # An encoder back at the same address whose leases end before any engine can pull them.
    restarted = EncoderProcess(servers["path"], "--port", port, "--kv-transfer-lease", "0.001").start()
    try:
        body = _chat({"role": "user", "content": [{"type": "text", "text": "What is this?"}, _image(7)]})
        response = _post(pair, "/v1/chat/completions", body)
        assert response.status_code == 500, response.text
        assert "embeddings did not arrive from its encoder" in response.json()["error"]["message"]
        text = _chat({"role": "user", "content": "Hello"})
        assert _ok(pair, "/v1/chat/completions", text)["choices"][0]["message"]["content"]
        assert wait_until(lambda: blocks_in_use(pair) == 0, 10)
        assert wait_until(lambda: _metric(restarted.url, "deepinfer_encoder_leases_active") == 0, 10)
    finally:
        restarted.kill()
