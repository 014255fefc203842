"""A request's images as the engine gets them: plain data, no torch (the scheduler, the KV
manager and the API process all read it).

The API side preprocesses each image (recipe/images) and expands its one placeholder in the
prompt to `num_tokens` image token ids; the runner encodes the pixels when a prefill reaches
those positions and puts the encoder's embeddings there. `content_hash` names the image's
content (its pixels and grid), which keys the runner's encoder-output cache and goes into the
prefix hashes of every block the image's tokens touch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

PATCH_PIXELS = 14 * 14  # pixels of one patch (the preprocessing's 14 x 14)


class ImageInput(msgspec.Struct, frozen=True, array_like=True):
    """One image of a prompt: its tokens are prompt positions offset .. offset + num_tokens - 1."""

    offset: int
    num_tokens: int
    patch_rows: int
    patch_cols: int
    pixels: bytes  # RGB uint8, (patch_rows * 14) x (patch_cols * 14) x 3, row-major
    content_hash: bytes  # image_content_hash(pixels, patch_rows, patch_cols)

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
        if image.patch_rows < 1 or image.patch_cols < 1 or len(image.pixels) != expected:
            raise ValueError(
                f"image {i}: {len(image.pixels)} bytes for a {image.patch_rows}x{image.patch_cols}-patch grid"
            )
        previous_end = image.end
