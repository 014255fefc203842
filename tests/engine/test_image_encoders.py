"""Image encoders' options and the engine's pull of their embeddings, without a model: the
options are refused where they mean nothing (each error naming the option), and `ImagePuller`
against a real `KVTransferServer` on loopback pulls leased embeddings, releases a lease it does
not need, and fails a request cleanly (never a hang) when the lease is over or the encoder gone;
the request waits (`num_pending`) while its pulls run, and an aborted one is forgotten."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deepinfer.config import ConfigError, EngineConfig
from deepinfer.engine.image_pull import ImagePuller
from deepinfer.image_input import EncodedAt, ImageInput, check_images
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from deepinfer.model.loader.load import check_model_engine
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.transport.kv_transfer import KVTransferServer
from tests.deepseek_v41.tiny_v41 import tiny_config
from tests.deepseek_v41.vision_inputs import vision_config

LAYOUT = "image-embeddings-v1 float32 test"
TOKENS, HIDDEN = 5, 4


def test_encoder_options_are_refused_where_they_mean_nothing(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^encoders: expected an http"):
        EngineConfig.from_kwargs(encoders=["127.0.0.1:9000"])
    with pytest.raises(ConfigError, match=r"^encoders: only a both or prefill"):
        EngineConfig.from_kwargs(role="decode", encoders=["http://127.0.0.1:9000"])
    with pytest.raises(ConfigError, match=r"^encoders: only a both or prefill"):
        EngineConfig.from_kwargs(role="encode", encoders=["http://127.0.0.1:9000"])
    for option, value in (
        ("kv_store", str(tmp_path)),
        ("speculative_method", "ngram"),
        ("kv_transfer", "store"),
    ):
        with pytest.raises(ConfigError, match=rf"^{option}: not an option of an encode-role server"):
            EngineConfig.from_kwargs(role="encode", **{option: value})
    with pytest.raises(ConfigError, match=r"^async_scheduling: image encoders"):
        EngineConfig.from_kwargs(encoders=["http://127.0.0.1:9000"], async_scheduling=True)
    with pytest.raises(ConfigError, match="encoder_timeout"):
        EngineConfig.from_kwargs(encoder_timeout=0)
    assert EngineConfig.from_kwargs(role="encode").disaggregation.role == "encode"


def test_encoders_are_refused_for_a_model_without_images(tmp_path) -> None:
    encoders = EngineConfig.from_kwargs(encoders=["http://127.0.0.1:9000"], device="cpu")
    gguf = tmp_path / "model.gguf"  # the Llama family: no tower, refused before it is read
    gguf.touch()
    with pytest.raises(ConfigError, match=r"^encoders: this model has no vision tower"):
        check_model_engine(encoders.replace(model=str(gguf)))
    merges_2x2 = ModelConfig.from_hf(json.loads(json.dumps(tiny_config())))  # a tower that takes no images
    with pytest.raises(ConfigError, match=r"^encoders: .*takes no images"):
        DeepseekV41ForCausalLM.check_engine(merges_2x2, encoders)
    DeepseekV41ForCausalLM.check_engine(ModelConfig.from_hf(vision_config()), encoders)


def test_the_command_line_names_the_flag(tmp_path) -> None:
    command = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "serve",
        "--role",
        "encode",
        "--encoder",
        "http://127.0.0.1:9",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 2 and "--encoder: only a both or prefill engine" in done.stderr, done.stderr
    # the encode role on a checkpoint it cannot encode for (a text-only Llama): refused before any
    # weight is read (the weights file is not even a safetensors file)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 256,
                "max_position_embeddings": 512,
            }
        )
    )
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    command = [sys.executable, "-m", "deepinfer.cli", "serve", str(tmp_path), "--role", "encode"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 2 and "is not a DeepSeek-V4.1 checkpoint with a vision tower" in done.stderr, (
        done.stderr
    )


def _leased(server: KVTransferServer, seed: int) -> tuple[ImageInput, np.ndarray]:
    embeds = np.random.default_rng(seed).standard_normal((TOKENS, HIDDEN), dtype=np.float32)
    key = bytes([seed]) * 32
    transfer_id = f"{key.hex()}-{seed}"
    assert server.lease(transfer_id, [key], [embeds.reshape(-1).view(np.uint8)])
    image = ImageInput(0, TOKENS, 1, 1, b"", key, encoded=EncodedAt(server.address, transfer_id))
    return image, embeds


@pytest.fixture
def server():
    server = KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=30.0)
    yield server
    server.close()


def _reaped(server: KVTransferServer) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        server.reap()
        if server.num_leases == 0:
            return True
        time.sleep(0.02)
    return False


def _waiting(images: list[ImageInput], request_id: str = "r") -> Sequence:
    request = EngineRequest(request_id, [0] * 2 * TOKENS, SamplingParams(), images=images)
    return Sequence(0, request, 0, list(request.prompt_token_ids), len(request.prompt_token_ids), b"")


def _polled(puller: ImagePuller, seq: Sequence) -> dict[str, str]:
    """poll() until `seq` is no longer waited for (the pulls are bounded: never a hang)."""
    deadline = time.monotonic() + 10
    failures: dict[str, str] = {}
    while puller.num_in_flight and time.monotonic() < deadline:
        failures.update(puller.poll())
        time.sleep(0.01)
    assert not puller.num_in_flight and seq.num_pending == 0
    return failures


def test_pulls_leased_embeddings_and_releases_what_it_has(server) -> None:
    puller = ImagePuller(LAYOUT, timeout_s=5.0)
    pulled, pulled_embeds = _leased(server, 1)
    cached, cached_embeds = _leased(server, 2)
    text = ImageInput(0, 1, 1, 1, bytes(14 * 14 * 3), bytes(32))  # pixels: left as it is
    check_images([pulled], TOKENS)  # pixels are not needed when an encoder has the image
    again = ImageInput(TOKENS, TOKENS, 1, 1, b"", pulled.content_hash, encoded=EncodedAt(server.address, "x"))
    cache = {cached.content_hash: cached_embeds.tobytes()}
    seq = _waiting([pulled, cached, again, text])
    puller.attach(seq, cache.get)
    assert seq.num_pending == 1 and seq.request.images[0] is pulled  # not admitted until it lands
    assert _polled(puller, seq) == {}
    out = seq.request.images
    assert out[0].embeds == pulled_embeds.tobytes() and out[0].encoded is None
    assert out[1].embeds == cached_embeds.tobytes() and out[2].embeds == out[0].embeds
    assert out[3] is text
    assert (puller.num_pulled, puller.num_reused) == (1, 1)
    assert _reaped(server)  # the cached image's lease released unread, not left to expire
    assert (server.num_sent, server.num_released, server.num_expired) == (2, 1, 0)
    # everything in the cache: nothing to wait for, the images carry their embeddings at once
    seq = _waiting([_leased(server, 2)[0]])
    puller.attach(seq, cache.get)
    assert seq.num_pending == 0 and not puller.num_in_flight
    assert seq.request.images[0].embeds == cached_embeds.tobytes()
    puller.close()


def _failure(puller: ImagePuller, image: ImageInput) -> str:
    seq = _waiting([image])
    puller.attach(seq, {}.get)
    (error,) = _polled(puller, seq).values()
    assert seq.request.images == [image]  # nothing landed
    return error


def test_an_expired_lease_or_a_gone_encoder_fails_the_request(server) -> None:
    puller = ImagePuller(LAYOUT, timeout_s=5.0)
    short = KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=0.1)
    image, _ = _leased(short, 3)
    time.sleep(0.2)
    assert re.search(r"did not arrive.*unknown", _failure(puller, image))
    short.close()
    gone, _ = _leased(server, 4)
    server.close()
    began = time.monotonic()
    assert "unreachable" in _failure(puller, gone)
    assert time.monotonic() - began < 5
    other = KVTransferServer("another model's embeddings", "127.0.0.1", 0, lease_s=30.0)
    image, _ = _leased(other, 5)
    assert "mismatch" in _failure(puller, image)
    assert _reaped(other)  # the lease ended with the refused pull
    other.close()
    puller.close()


def test_an_abort_while_pulling_leaves_nothing_behind(server) -> None:
    puller = ImagePuller(LAYOUT, timeout_s=5.0)
    seq = _waiting([_leased(server, 6)[0]])
    puller.attach(seq, {}.get)
    puller.forget([seq])
    assert not puller.num_in_flight and puller.poll() == {}
    puller.close()
