"""The image paths bound what one request costs (issue 30, findings 4 and 8).

The encoder (`--role encode`) checks the API key before reading a body, refuses bodies past
--max-body-bytes and requests with more than --max-images-per-request images, and reads each
image's size from its header before decoding it: a 268 KiB PNG that declares 8192 x 8192 RGBA
pixels (3 GiB once decoded) is a 400 naming it, on the encoder and on a vision engine alike.
"""

from __future__ import annotations

import base64
import re
import struct
import zlib
from functools import cache

import httpx
import pytest

from tests.deepseek.tiny_checkpoint import write_tokenizer
from tests.deepseek_v41.tiny_v41 import build_v41
from tests.deepseek_v41.vision_inputs import png_base64, vision_config
from tests.pd.cluster import start_all
from tests.security.conftest import TENANT_A, as_key, error_of, raw_connection
from tests.server.server_process import AnnouncedProcess, ServerProcess

pytestmark = pytest.mark.slow
deepseek_reference = pytest.importorskip("tests.recipe.deepseek_reference")

BOMB_SIDE = 8192
V41 = "tiny-v41"
_ENCODER = re.compile(r"DeepInfer encoder is serving .* at (http://\S+) ")


class EncoderProcess(AnnouncedProcess):
    def __init__(self, path: str, *options: str) -> None:
        command = ["serve", path, "--role", "encode", "--num-threads", "1", "--log-level", "warning"]
        super().__init__([*command, "--port", "0", *options], _ENCODER, 300.0)


@cache
def png_bomb() -> bytes:
    """A valid 8192 x 8192 RGBA PNG of zeros, compressed 256 rows at a time (never held whole)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(6)
    rows = bytes(1 + 4 * BOMB_SIDE) * 256  # each row: filter byte 0, then its pixels
    data = b"".join(packer.compress(rows) for _ in range(BOMB_SIDE // 256)) + packer.flush()
    header = struct.pack(">IIBBBBB", BOMB_SIDE, BOMB_SIDE, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    path = tmp_path_factory.mktemp("edge_v41")
    vocab = write_tokenizer(path, deepseek_reference.tokenizer_json("deepseek_v41"))
    build_v41(path, vision_config(vocab_size=vocab, max_position_embeddings=2048), seed=30)
    encoder = EncoderProcess(str(path), "--api-key", TENANT_A)
    engine = ServerProcess(str(path), "--num-threads", "1", "--served-model-name", V41, "--api-key", TENANT_A)
    try:
        start_all([encoder, engine])  # type: ignore[list-item]
        yield {"encoder": encoder, "engine": engine}
    finally:
        for process in (encoder, engine):
            process.kill()


def _encode(encoder, urls: list[str], key: str | None = TENANT_A) -> httpx.Response:
    body = {"images": [{"url": url} for url in urls]}
    return httpx.post(encoder.url + "/v1/encode", json=body, headers=as_key(key), timeout=120)


def test_the_encoder_wants_the_key_before_the_body(vision) -> None:
    encoder = vision["encoder"]
    small = _data_url(base64.b64decode(png_base64(1)))
    assert error_of(_encode(encoder, [small], None), 401)["code"] == "invalid_api_key"
    assert error_of(_encode(encoder, [small], "sk-stranger"), 401)["code"] == "invalid_api_key"
    head = f"POST /v1/encode HTTP/1.1\r\nHost: edge\r\ncontent-length: {120 << 20}\r\n\r\n"
    with raw_connection(encoder.url, 60) as sock:  # 120 MiB announced, none sent
        sock.sendall(head.encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")
    reply = _encode(encoder, [small])
    assert reply.status_code == 200 and len(reply.json()["images"]) == 1


def test_the_encoder_bounds_bodies_and_images(vision) -> None:
    encoder = vision["encoder"]
    head = (
        f"POST /v1/encode HTTP/1.1\r\nHost: edge\r\nauthorization: Bearer {TENANT_A}\r\n"
        f"content-length: {120 << 20}\r\n\r\n"
    )
    with raw_connection(encoder.url, 60) as sock:
        sock.sendall(head.encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    many = [_data_url(base64.b64decode(png_base64(seed))) for seed in range(17)]
    assert "at most 16" in error_of(_encode(encoder, many), 400)["message"]


def test_a_decompression_bomb_is_refused_from_its_header(vision) -> None:
    bomb = _data_url(png_bomb())
    assert len(png_bomb()) < 300 << 10
    error = error_of(_encode(vision["encoder"], [bomb]), 400)
    assert f"{BOMB_SIDE}x{BOMB_SIDE}" in error["message"]
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": bomb}}]
    body = {"model": V41, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    reply = httpx.post(
        vision["engine"].url + "/v1/chat/completions", json=body, headers=as_key(TENANT_A), timeout=120
    )
    error = error_of(reply, 400)
    assert error["param"] == "messages[0].content[1]" and f"{BOMB_SIDE}x{BOMB_SIDE}" in error["message"]
