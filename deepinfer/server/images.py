"""A request's images on the API side: preprocessed in worker processes (decoding and resizing
are CPU-bound and would stall the event loop), then placed in the prompt.

Each image's one placeholder token becomes `num_tokens` placeholder ids, the positions whose
embeddings the vision tower fills (start, rows each ending in a newline, end); the prompt's
length is then the one every limit and the usage count. No torch here: numpy and Pillow only.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import msgspec

from deepinfer.image_input import ImageInput, image_content_hash
from deepinfer.recipe.images.errors import ImageInputError
from deepinfer.recipe.images.fetch import FetchPolicy, refuse_unless_fetching
from deepinfer.recipe.images.source import prepare_image
from deepinfer.recipe.ir import ImagePart
from deepinfer.server.errors import ApiError


@dataclass(slots=True, frozen=True)
class ImageRefused:
    """A worker's answer for a bad image (plain data: ImageInputError does not pickle back)."""

    param: str | None
    message: str


def prepare_for_engine(
    part: ImagePart, policy: FetchPolicy | None = None, max_pixels: int | None = None
) -> ImageInput | ImageRefused:
    """Runs in a worker: one image part -> the engine's ImageInput (offset set by the caller)."""
    try:
        image = prepare_image(part, policy, max_pixels)
    except ImageInputError as error:
        return ImageRefused(error.param, str(error))
    rows, cols = image.layout.patch_rows, image.layout.patch_cols
    pixels = image.pixels.tobytes()
    return ImageInput(0, image.num_tokens, rows, cols, pixels, image_content_hash(pixels, rows, cols))


@dataclass(slots=True, frozen=True)
class ImageLimits:
    """What one request may make a server decode (--max-images-per-request, --image-max-pixels):
    its memory and time are bounded by them, not by the client."""

    max_images: int
    max_pixels: int

    def check_count(self, parts: list[ImagePart]) -> None:
        if len(parts) > self.max_images:
            where = parts[self.max_images].path or "images"
            raise ApiError(
                400,
                f"{where}: the request has {len(parts)} images; at most {self.max_images} are accepted",
                param=where,
            )


def image_pool(workers: int) -> ProcessPoolExecutor:
    # spawn: a forked child would inherit the event loop's and the engine client's sockets.
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


async def prepare_images(
    pool: ProcessPoolExecutor, parts: list[ImagePart], policy: FetchPolicy, limits: ImageLimits
) -> list[ImageInput]:
    """Every part preprocessed (in parallel across the pool); the first bad one is a 400 naming
    it, as are more images than the limit (before any is read)."""
    limits.check_count(parts)
    loop = asyncio.get_running_loop()
    results = await asyncio.gather(
        *(loop.run_in_executor(pool, prepare_for_engine, p, policy, limits.max_pixels) for p in parts)
    )
    for result in results:
        if isinstance(result, ImageRefused):
            raise ApiError(400, result.message, param=result.param)
    return [r for r in results if isinstance(r, ImageInput)]


def refuse_unfetchable(parts: list[ImagePart], policy: FetchPolicy) -> None:
    """This server's URL policy holds wherever an image is fetched: with fetching off, an http(s)
    image is a 400 naming its part here, even when an encoder (with its own policy) would fetch it."""
    for part in parts:
        if part.url is not None and not part.url.startswith("data:"):
            try:
                refuse_unless_fetching(policy, part.path or "")
            except ImageInputError as error:
                raise ApiError(400, str(error), param=error.param) from None


def expand_placeholders(
    token_ids: list[int],
    images: list[ImageInput],
    placeholder_id: int,
    param: str,
    spelling: str = "the image token",
) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each placeholder (token `placeholder_id`, written `spelling`) repeated to
    its image's token count, and the images with their offsets in it. Placeholders and images
    pair up in order (RenderedPrompt.images)."""
    where = [i for i, token in enumerate(token_ids) if token == placeholder_id]
    if len(where) != len(images):
        raise ApiError(
            400,
            f"{param}: the prompt holds {len(where)} image placeholders for {len(images)} images "
            f"(is {spelling} written in the text?)",
            param=param,
        )
    out: list[int] = []
    placed: list[ImageInput] = []
    previous = 0
    for at, image in zip(where, images, strict=True):
        out += token_ids[previous:at]
        placed.append(msgspec.structs.replace(image, offset=len(out)))
        out += [placeholder_id] * image.num_tokens
        previous = at + 1
    out += token_ids[previous:]
    return out, placed
