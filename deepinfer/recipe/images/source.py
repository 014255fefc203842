"""From an ImagePart to what the model gets: the bytes (inline, or fetched when allowed), then
DeepSeek-V4.1's preprocessing. `prepare_image` takes and returns plain, picklable data, so a
server can run it in a process pool, off its event loop."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.recipe.images.decode import bytes_from_data_url
from deepinfer.recipe.images.fetch import FetchPolicy, fetch_image
from deepinfer.recipe.images.preprocess import ImagePixels, preprocess
from deepinfer.recipe.ir import ImagePart

DEFAULT_DETAIL = "high"  # DeepSeek's codec's, for a part that names none


def image_bytes(part: ImagePart, policy: FetchPolicy) -> bytes:
    where = part.path or ""
    url = part.url or ""
    if url.startswith("data:"):
        return bytes_from_data_url(url, where)
    return fetch_image(url, policy, where)


def prepare_image(
    part: ImagePart, policy: FetchPolicy | None = None, max_pixels: int | None = None
) -> ImagePixels:
    """The model's view of one image part; failures raise ImageInputError naming the part."""
    data = image_bytes(part, policy or FetchPolicy())
    return preprocess(data, part.detail or DEFAULT_DETAIL, part.path or "", max_pixels)


def image_token_adjustment(images: Sequence[ImagePixels]) -> int:
    """Tokens the images add to a prompt beyond their one placeholder each: the prompt's length
    for context, usage and max-token checks is len(token_ids) plus this."""
    return sum(image.num_tokens - 1 for image in images)
