"""Where an image lands in DeepSeek-V4.1: its size in pixels, its patch grid, its tokens.

The vision tower cuts an image into 14x14 patches and merges 3x3 of them into one token; each
row of tokens ends with a newline token and the image is framed by start and end tokens:

    <start> (<image> * cols + <newline>) * rows <end>        tokens = rows * (cols + 1) + 2

The size is fitted as DeepSeek's codec fits it (`deepseek-recipe` 0.2.0): scale up to at least
MIN_PIXELS, round each side up to whole patches, and if that makes more than MAX_TOKENS tokens
solve for the largest grid of that aspect ratio under the cap. The codec repeats this on its own
result until nothing moves (rounding can leave a size under MIN_PIXELS, which the next round
grows); the sides of the picture it sends are also kept within MAX_SIDE (WebP's limit, in whole
patches), which the token count does not apply: it counts the fitted size of what it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PATCH = 14
MERGE = 3  # patches per token along each side
MAX_TOKENS = 1024
MIN_PIXELS = 544 * 544
MAX_SIDE = (16383 // PATCH) * PATCH
_MAX_ROUNDS = 64  # the codec gives up too ("did not converge"); no size seen needs more than a few


@dataclass(slots=True, frozen=True)
class ImageLayout:
    """A fitted image: `width` x `height` pixels, `cols` x `rows` tokens (plus newlines/frame)."""

    width: int
    height: int

    @property
    def patch_cols(self) -> int:
        return self.width // PATCH

    @property
    def patch_rows(self) -> int:
        return self.height // PATCH

    @property
    def cols(self) -> int:
        return -(-self.patch_cols // MERGE)

    @property
    def rows(self) -> int:
        return -(-self.patch_rows // MERGE)

    @property
    def num_tokens(self) -> int:
        return self.rows * (self.cols + 1) + 2


def _under_cap(width: float, height: float) -> ImageLayout:
    """The largest grid of this aspect ratio within MAX_TOKENS (DeepSeek's closed form)."""
    ratio = height / width
    budget = MAX_TOKENS - 2  # rows * (cols + 1)
    cols_f = math.sqrt(budget / ratio + 0.25) - 0.5
    rows_f = cols_f * ratio
    cell = PATCH * MERGE
    if cols_f < 1.0:
        return ImageLayout(cell, (budget // 2) * cell)
    if rows_f < 1.0:
        return ImageLayout((budget - 1) * cell, cell)
    beta = min(math.floor(cols_f) * cell / width, math.floor(rows_f) * cell / height)
    return ImageLayout(math.floor(width * beta / PATCH) * PATCH, math.floor(height * beta / PATCH) * PATCH)


def _fit_once(width: int, height: int) -> ImageLayout:
    area = width * height
    if 0 < area < MIN_PIXELS:
        scale = (MIN_PIXELS / area) ** 0.5
        width, height = int(width * scale), int(height * scale)
    layout = ImageLayout(math.ceil(width / PATCH) * PATCH, math.ceil(height / PATCH) * PATCH)
    if layout.num_tokens > MAX_TOKENS:
        layout = _under_cap(width, height)
    return layout


def _fit(width: int, height: int, max_side: int | None) -> ImageLayout:
    for _ in range(_MAX_ROUNDS):
        layout = _fit_once(width, height)
        if max_side is not None:
            layout = ImageLayout(min(layout.width, max_side), min(layout.height, max_side))
        if (layout.width, layout.height) == (width, height):
            return layout
        width, height = layout.width, layout.height
    raise ValueError(f"fitting a {width}x{height} image did not settle")


def fit_image(width: int, height: int) -> ImageLayout:
    """The size the codec resizes (and pads) a width x height picture to."""
    return _fit(width, height, MAX_SIDE)


def count_tokens(width: int, height: int) -> int:
    """The tokens an image of this size takes in the prompt, as the codec counts them."""
    return _fit(width, height, None).num_tokens


def contain(width: int, height: int, box: ImageLayout) -> tuple[int, int, int, int]:
    """Where a width x height picture goes inside `box`, aspect ratio kept: (left, top, w, h).

    Sides and the leading margins (half the room left) round half to even, as the codec places
    the picture (checked byte for byte against its output)."""
    scale = min(box.width / width, box.height / height)
    inner_w = max(1, min(box.width, round(width * scale)))
    inner_h = max(1, min(box.height, round(height * scale)))
    return round((box.width - inner_w) / 2), round((box.height - inner_h) / 2), inner_w, inner_h
