"""A request's images as the engine gets them: plain data, no torch (the scheduler, the KV
manager and the API process all read it).

The API side preprocesses each image (recipe/images) and expands its one placeholder in the
prompt to `num_tokens` image token ids; the runner encodes the pixels when a prefill reaches
those positions and puts the encoder's embeddings there. `content_hash` names the image's
content (its pixels and grid), which keys the runner's encoder-output cache and goes into the
prefix hashes of every block the image's tokens touch.

With image encoders (`--encoder`, an encode-role server), an image comes to the engine without
pixels: `encoded` says where its embeddings are leased, the engine pulls them when the request
arrives (engine/image_pull.py) and carries them in `embeds` until the prefill has used them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

PATCH_PIXELS = 14 * 14  # pixels of one patch (the preprocessing's 14 x 14)


class EncodedAt(msgspec.Struct, frozen=True, array_like=True):
    """Where an encoder leased an image's embeddings: its transfer listener and the lease."""

    address: str  # host:port
    transfer_id: str


class ImageInput(msgspec.Struct, frozen=True, array_like=True):
    """One image of a prompt: its tokens are prompt positions offset .. offset + num_tokens - 1.
    Either `pixels` (the runner encodes them) or `encoded` / `embeds` (an encoder did)."""

    offset: int
    num_tokens: int
    patch_rows: int
    patch_cols: int
    pixels: bytes  # RGB uint8, (patch_rows * 14) x (patch_cols * 14) x 3, row-major; b"": encoded elsewhere
    content_hash: bytes  # image_content_hash(pixels, patch_rows, patch_cols)
    encoded: EncodedAt | None = None  # leased by an encoder, not yet pulled
    embeds: bytes = b""  # float32 [num_tokens, hidden], row-major: pulled from the encoder

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_content_hash(pixels: bytes, patch_rows: int, patch_cols: int) -> bytes:
    """SHA-256 of the grid and the pixels the tower normalises (the same pixels always normalise
    to the same patches, so this names the encoder's input)."""
    h = hashlib.sha256(b"deepinfer-image-v1\0")
    h.update(struct.pack("<II", patch_rows, patch_cols))
    h.update(pixels)
    return h.digest()


def images_in(images: Sequence[ImageInput], start: int, end: int) -> list[ImageInput]:
    """The images with a token among positions start .. end - 1."""
    return [image for image in images if image.offset < end and image.end > start]


def image_extra_keys(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """A block's extra prefix-hash keys: the content hashes of the images among its positions
    (empty without any, so a text block hashes as before)."""
    return b"".join(image.content_hash for image in images_in(images, start, end))


def check_images(images: Sequence[ImageInput], num_prompt_tokens: int) -> None:
    """ValueError unless the images lie in order inside the prompt without overlapping and
    each carries the pixels of its grid (the API side builds them so: this guards the engine)."""
    previous_end = 0
    for i, image in enumerate(images):
        if image.offset < previous_end or image.end > num_prompt_tokens or image.num_tokens < 1:
            raise ValueError(
                f"image {i}: positions {image.offset}..{image.end - 1} are not its own in the prompt"
            )
        expected = image.patch_rows * image.patch_cols * PATCH_PIXELS * 3
        elsewhere = (image.encoded is not None or image.embeds) and not image.pixels
        if image.patch_rows < 1 or image.patch_cols < 1 or not (elsewhere or len(image.pixels) == expected):
            raise ValueError(
                f"image {i}: {len(image.pixels)} bytes for a {image.patch_rows}x{image.patch_cols}-patch grid"
            )
        previous_end = image.end


def embeddings_layout(config: Mapping[str, Any]) -> str:
    """What an image's embeddings are for a V4.1 config.json: float32 rows of the LM's width from
    this vision tower. An encoder and its engines compare it so that an encoder of another
    model is refused rather than spliced in."""
    described = json.dumps(
        {
            "vision": config.get("vision_config"),
            "hidden": (config.get("text_config") or {}).get("hidden_size"),
        },
        sort_keys=True,
    )
    return f"image-embeddings-v1 float32 {hashlib.sha256(described.encode()).hexdigest()[:16]}"
