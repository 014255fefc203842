"""Images through the engine: the vision tower's embeddings at the image token positions, the
encoder-output cache, and prefix hashes that name the image.

A request carries its images as ImageInput (pixels + grid, at prompt positions filled with the
placeholder id); the runner encodes an image when a prefill chunk reaches it and the model puts
the embeddings in place of those positions' token embeddings. With image encoders
(`--encoder`) the embeddings are pulled from an encoder's lease while the request waits.
"""

from __future__ import annotations

import socket
import time

import msgspec
import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache.prefix import extend_block_hashes
from deepinfer.image_input import EncodedAt, ImageInput
from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from deepinfer.recipe.images.source import prepare_image
from deepinfer.recipe.ir import ImagePart
from deepinfer.runner.image_embeds import image_patches
from deepinfer.sequence import EngineRequest
from deepinfer.server.images import expand_placeholders, prepare_for_engine
from deepinfer.transport.kv_transfer import KVTransferServer
from tests.deepseek.tiny_checkpoint import build_tokenizer
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41
from tests.deepseek_v41.vision_inputs import png_base64, vision_config

BLOCK = 4
PLACEHOLDER = 7
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> TinyV41:
    path = tmp_path_factory.mktemp("v41_vision_engine")
    vocab = build_tokenizer(path)
    return build_v41(path, vision_config(vocab_size=vocab, max_position_embeddings=1024), seed=5)


def _image(seed: int) -> ImageInput:
    part = ImagePart(url="data:image/png;base64," + png_base64(seed), path="image")
    image = prepare_for_engine(part)
    assert isinstance(image, ImageInput)
    return image


def _prompt(image: ImageInput, before: list[int], after: list[int]) -> tuple[list[int], ImageInput]:
    ids, (placed,) = expand_placeholders([*before, PLACEHOLDER, *after], [image], PLACEHOLDER, "p")
    return ids, placed


def _run(llm: LLM, requests: list[EngineRequest]) -> dict[str, tuple[list[int], int]]:
    """request id -> (greedy tokens, cached prompt tokens)."""
    core = llm.engine.core
    for request in requests:
        core.add_request(request)
    out: dict[str, tuple[list[int], int]] = {r.request_id: ([], 0) for r in requests}
    while core.has_work():
        for o in core.step():
            tokens, cached = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, max(cached, o.num_cached_tokens))
    return out


def _request(request_id: str, ids: list[int], images: list[ImageInput]) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return EngineRequest(request_id, ids, params, images=images)


def _standalone_greedy(model: DeepseekV41ForCausalLM, ids: list[int], image: ImageInput) -> list[int]:
    """The model alone over its contiguous cache, the whole prompt in one step with the tower's
    output written in by hand."""
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[image.offset : image.end] = True
    embeds = model.embed_images(image_patches(image), [(image.patch_rows, image.patch_cols)])
    out: list[int] = []
    chunk, kwargs = ids, {"image_mask": mask, "image_embeds": embeds}
    with torch.no_grad():
        while len(out) < MAX_TOKENS:
            start = cache.length(seq)
            layout = StepLayout((start,), (len(chunk),))
            positions = torch.arange(start, start + len(chunk))
            hidden = model.forward_cached(
                torch.tensor(chunk), positions, layout, cache.step([seq], layout), **kwargs
            )
            out.append(int(model.compute_logits(hidden)[-1].argmax()))
            chunk, kwargs = out[-1:], {}
    return out


def test_patches_match_the_preprocessing():
    part = ImagePart(url="data:image/png;base64," + png_base64(3), path="image")
    assert torch.equal(image_patches(_image(3)), torch.from_numpy(prepare_image(part).patches()))


def test_spliced_embeddings_are_the_encoders_output_at_the_image_positions(checkpoint, monkeypatch):
    llm = LLM(
        model=str(checkpoint.path),
        block_size=BLOCK,
        num_threads=1,
        num_blocks=256,
        max_num_batched_tokens=64,  # the image's 184 tokens span several chunks
        prefill_chunk_size=64,
    )
    model = llm.engine.core.runner.model
    image = _image(1)
    ids, placed = _prompt(image, [11, 12, 13, 14, 15], [16, 17])
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    forward_cached = model.forward_cached

    def spy(input_ids, positions, layout, step, features=None, **kwargs):
        mask = kwargs.get("image_mask")
        if mask is not None:
            seen.append((positions[mask].clone(), kwargs["image_embeds"].clone(), input_ids[mask].clone()))
        return forward_cached(input_ids, positions, layout, step, features, **kwargs)

    monkeypatch.setattr(model, "forward_cached", spy)
    tokens, _ = _run(llm, [_request("a", ids, [placed])])["a"]

    assert len(seen) > 1  # chunked: each chunk took its rows of the image
    positions = torch.cat([p for p, _, _ in seen])
    assert positions.tolist() == list(range(placed.offset, placed.end))
    assert torch.cat([t for _, _, t in seen]).eq(PLACEHOLDER).all()
    expected = model.embed_images(image_patches(image), [(image.patch_rows, image.patch_cols)])
    assert torch.equal(torch.cat([e for _, e, _ in seen]), expected)
    assert llm.engine.core.runner.images.num_encoded == 1  # encoded once, for every chunk
    monkeypatch.undo()
    assert tokens == _standalone_greedy(model, ids, placed)


def test_same_image_is_a_prefix_hit_and_a_different_one_is_not(checkpoint):
    llm = LLM(model=str(checkpoint.path), block_size=BLOCK, num_threads=1, num_blocks=512)
    runner = llm.engine.core.runner
    first, other = _image(1), _image(2)
    before, after = [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24]
    ids, placed = _prompt(first, before, after)
    _run(llm, [_request("turn1", ids, [placed])])
    assert runner.images.num_encoded == 1

    again = _run(llm, [_request("turn2", [*ids, 25, 26, 27, 28], [placed])])["turn2"]
    assert again[1] >= placed.end // BLOCK * BLOCK  # every block the image touches is a hit

    other_ids, other_placed = _prompt(other, before, after)
    assert other_ids == ids  # the same token ids: only the picture differs
    miss = _run(llm, [_request("other", other_ids, [other_placed])])["other"]
    assert miss[1] == placed.offset // BLOCK * BLOCK  # the hit stops at the image's first block
    assert runner.images.num_encoded == 2

    # The first picture after other text: no prefix hit there, but the encoder's output is cached.
    moved_ids, moved = _prompt(first, [30, 31], after)
    _run(llm, [_request("moved", moved_ids, [moved])])
    assert runner.images.num_encoded == 2


def test_block_hashes_name_the_image():
    a, b = _image(1), _image(2)
    ids, placed_a = _prompt(a, [11, 12, 13], [14])
    _, placed_b = _prompt(b, [11, 12, 13], [14])
    root = b"r" * 32
    with_a: list[bytes] = []
    with_b: list[bytes] = []
    text_only: list[bytes] = []
    extend_block_hashes(with_a, root, ids, BLOCK, [placed_a])
    extend_block_hashes(with_b, root, ids, BLOCK, [placed_b])
    extend_block_hashes(text_only, root, ids, BLOCK)
    first_image_block = placed_a.offset // BLOCK
    assert with_a[:first_image_block] == with_b[:first_image_block] == text_only[:first_image_block]
    assert all(x != y for x, y in zip(with_a[first_image_block:], with_b[first_image_block:], strict=True))


def test_images_that_do_not_fit_the_prompt_are_refused_on_arrival(checkpoint):
    llm = LLM(model=str(checkpoint.path), block_size=BLOCK, num_threads=1, num_blocks=64)
    ids, placed = _prompt(_image(1), [11, 12], [13])
    core = llm.engine.core
    with pytest.raises(ValueError, match="positions"):
        core.add_request(_request("short", ids[:-5], [placed]))  # the image runs past the prompt
    with pytest.raises(ValueError, match="bytes"):
        core.add_request(_request("cut", ids, [msgspec.structs.replace(placed, pixels=placed.pixels[:-3])]))
    assert not core.has_work()


def test_a_stalled_encoder_holds_up_its_request_alone(checkpoint):
    """Embeddings pulled from an encoder (`--encoder`) while the engine runs on: a text request
    and an image request whose lease answers finish while another image's encoder has taken the
    pull and never answers; that request then ends with the error, holding no KV block, and one
    aborted mid-pull leaves nothing behind."""
    timeout = 3.0
    llm = LLM(
        model=str(checkpoint.path),
        block_size=BLOCK,
        num_threads=1,
        num_blocks=256,
        encoders=["http://127.0.0.1:9"],  # the API side's; the engine only pulls from the leases
        kv_transfer_timeout=timeout,
    )
    core = llm.engine.core
    model = core.runner.model
    stalled = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog, unanswered
    encoder = KVTransferServer(core.image_puller.layout, "127.0.0.1", 0, lease_s=30.0)

    def leased(seed: int, address: str) -> tuple[list[int], ImageInput, ImageInput]:
        ids, placed = _prompt(_image(seed), [11, 12], [13, 14])
        encoded = EncodedAt(address, f"lease-{seed}")
        return ids, placed, msgspec.structs.replace(placed, pixels=b"", encoded=encoded)

    ids, placed, pulled = leased(1, encoder.address)
    embeds = model.embed_images(image_patches(placed), [(placed.patch_rows, placed.patch_cols)])
    assert encoder.lease("lease-1", [placed.content_hash], [embeds.numpy().reshape(-1).view(np.uint8)])
    stalled_address = f"127.0.0.1:{stalled.getsockname()[1]}"
    stalled_ids, _, stalled_image = leased(2, stalled_address)
    aborted_ids, _, aborted_image = leased(3, stalled_address)

    began = time.monotonic()
    core.add_request(_request("stalled", stalled_ids, [stalled_image]))
    core.add_request(_request("aborted", aborted_ids, [aborted_image]))
    core.add_request(_request("pulled", ids, [pulled]))
    core.add_request(_request("text", [11, 12, 13, 14, 15], []))
    assert time.monotonic() - began < timeout  # nothing waited for the stalled pull on arrival
    assert core.abort("aborted") and core.image_puller.num_in_flight == 2
    tokens: dict[str, list[int]] = {"pulled": [], "text": []}
    ended: dict[str, tuple[float, str | None]] = {}
    while core.has_work():
        for out in core.step():
            assert out.request_id != "aborted"
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                ended[out.request_id] = (time.monotonic() - began, out.error)
    assert ended["text"][0] < timeout and ended["pulled"][0] < timeout  # not behind the stalled pull
    assert len(tokens["text"]) == MAX_TOKENS
    assert tokens["pulled"] == _standalone_greedy(model, ids, placed)  # the encoder's rows spliced in
    assert core.runner.images.num_encoded == 0  # the engine's tower ran on nothing
    seconds, error = ended["stalled"]
    assert seconds >= timeout and "did not arrive from its encoder" in error and "took longer" in error
    assert core.kv.num_used_blocks == 0 and core.image_puller.num_in_flight == 0
    stalled.close()
    encoder.close()
    llm.close()
