"""DeepSeek-V4.1's image preprocessing: encoded bytes -> the pixels and tokens the model gets.

The steps are those of DeepSeek's codec (`deepseek-recipe` 0.2.0, checked against it in
tests/recipe/test_images.py):

1. decode to RGB (decode.py); `detail: low` first shrinks the picture (OpenCV area filter) to
   LOW_DETAIL_SIDE on its long side;
2. fit the size (geometry.py), scale the picture into it with its aspect ratio kept (OpenCV
   cubic, resample.py) and pad the rest, centred, with grey 127 (0 after normalisation);
3. the codec hands the engine this picture as a WebP at quality 90, so the model sees it after a
   lossy round trip; the same encoder (libwebp through Pillow) gives the same bytes, so the
   pixels here are the ones DeepSeek's engine decodes;
4. normalise to (x / 255 - 0.5) / 0.5 and cut into 14x14 patches in scanline order
   (`ImagePixels.patches`), which is what the vision tower reads.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from deepinfer.recipe.images.decode import decode_rgb
from deepinfer.recipe.images.errors import ImageInputError
from deepinfer.recipe.images.geometry import PATCH, ImageLayout, contain, count_tokens, fit_image
from deepinfer.recipe.images.resample import resize_area, resize_cubic

DETAILS: tuple[str, ...] = ("low", "high", "original", "auto")
LOW_DETAIL_SIDE = 512
PAD = 127  # int(0.5 * 255): the normalisation mean, so padding is 0 to the model
WEBP_QUALITY = 90
MEAN = 0.5
STD = 0.5


@dataclass(slots=True, frozen=True)
class ImagePixels:
    """One preprocessed image: `webp`, the picture as the codec hands it to the engine; `pixels`,
    HWC uint8 RGB of `layout`'s size decoded from it; and its token count."""

    webp: bytes
    pixels: np.ndarray
    layout: ImageLayout
    num_tokens: int

    def patches(self) -> np.ndarray:
        """float32 (patch_rows * patch_cols, 3, 14, 14), normalised, patches in scanline order."""
        rows, cols = self.layout.patch_rows, self.layout.patch_cols
        chw = (self.pixels.astype(np.float32) / np.float32(255) - np.float32(MEAN)) / np.float32(STD)
        grid = chw.reshape(rows, PATCH, cols, PATCH, 3)
        return np.ascontiguousarray(grid.transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, PATCH, PATCH))


def preprocess(
    data: bytes, detail: str = "high", where: str = "", max_pixels: int | None = None
) -> ImagePixels:
    """The model's view of an encoded image; bad input (or more than `max_pixels` pixels) raises
    ImageInputError naming `where`."""
    if detail not in DETAILS:
        raise ImageInputError(where, f"detail must be one of {', '.join(DETAILS)}, not {detail!r}")
    rgb = decode_rgb(data, where, max_pixels)
    if detail == "low":
        rgb = _shrink_to(rgb, LOW_DETAIL_SIDE)
    height, width = rgb.shape[:2]
    box = fit_image(width, height)
    left, top, inner_w, inner_h = contain(width, height, box)
    canvas = np.full((box.height, box.width, 3), PAD, dtype=np.uint8)
    canvas[top : top + inner_h, left : left + inner_w] = resize_cubic(rgb, inner_w, inner_h)
    webp = _encode_webp(canvas)
    return ImagePixels(
        webp=webp, pixels=_decode_webp(webp), layout=box, num_tokens=count_tokens(box.width, box.height)
    )


def _shrink_to(rgb: np.ndarray, side: int) -> np.ndarray:
    height, width = rgb.shape[:2]
    longest = max(width, height)
    if longest <= side:
        return rgb
    scale = side / longest
    return resize_area(rgb, max(1, round(width * scale)), max(1, round(height * scale)))


def _encode_webp(rgb: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "WEBP", quality=WEBP_QUALITY, method=4)
    return buffer.getvalue()


def _decode_webp(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as decoded:
        return np.asarray(decoded.convert("RGB"), dtype=np.uint8)
