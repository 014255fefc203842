"""Resizing as DeepSeek's codec resizes, to the bit: OpenCV's 8-bit INTER_CUBIC and INTER_AREA.

DeepSeek-V4.1's images pass through OpenCV (in `deepseek-recipe`) before the model sees them,
so a resize that is merely close (Pillow's, a float one) leaves pixels off by one here and there,
and the lossy WebP step after it turns those into differences of tens of levels. What is
reproduced, from OpenCV 4.12's `resize.cpp` as DeepSeek's build runs it:

- cubic: taps from `(d + 0.5) * scale - 0.5` in float32, Keys' kernel with a = -0.75, weights
  rounded to 11-bit fixed point; the horizontal pass sums integers; the vertical pass runs in
  float32 over blocks of 8 values (the 128-bit SIMD path, rounded half to even) and in fixed
  point for the tail of each row (rounded half up).
- area (shrinking only): fractional cell weights accumulated in float32 in OpenCV's order; an
  exact integer factor takes the block-average path instead, where 2x2 blocks of 16 pixels go
  through SIMD (rounded half up) and the rest through float (half to even).

Arrays are HWC uint8 with any channel order (every channel is resized alike).
"""

from __future__ import annotations

import numpy as np

_COEF_BITS = 11
_COEF_SCALE = 1 << _COEF_BITS
_SIMD_I16_LANES = 8  # int16 lanes of a 128-bit register: the cubic vertical pass's block
_SIMD_U8_LANES = 16  # uint8 lanes: the 2x2 area path takes 3 * 16 values per step
_ROW_CHUNK = 128  # output rows per vectorised block (bounds the temporary arrays)


def _cubic_weights(frac: np.ndarray) -> np.ndarray:
    a = np.float32(-0.75)
    one = np.float32(1)
    x1 = frac + one
    c0 = ((a * x1 - np.float32(5) * a) * x1 + np.float32(8) * a) * x1 - np.float32(4) * a
    c1 = ((a + np.float32(2)) * frac - (a + np.float32(3))) * frac * frac + one
    g = one - frac
    c2 = ((a + np.float32(2)) * g - (a + np.float32(3))) * g * g + one
    c3 = one - c0 - c1 - c2
    weights = np.stack([c0, c1, c2, c3], axis=-1).astype(np.float32)
    return np.rint(weights * np.float32(_COEF_SCALE)).astype(np.int64)  # cvRound: half to even


def _cubic_taps(src: int, dst: int) -> tuple[np.ndarray, np.ndarray]:
    scale = 1.0 / (dst / src)
    pos = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    first = np.floor(pos)
    frac = (pos - first).astype(np.float32)
    index = np.clip(first.astype(np.int64)[:, None] + np.arange(-1, 3)[None, :], 0, src - 1)
    return index, _cubic_weights(frac)


def resize_cubic(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """OpenCV `resize(..., INTER_CUBIC)` of an HWC uint8 image to width x height."""
    h, w, cn = image.shape
    if (w, h) == (width, height):
        return image.copy()
    x_index, x_weights = _cubic_taps(w, width)
    y_index, y_weights = _cubic_taps(h, height)
    # Only the source rows some output row reads go through the horizontal pass (a big shrink
    # reads a fraction of them); `y_index` is renumbered into that list.
    needed, y_index = np.unique(y_index, return_inverse=True)
    y_index = y_index.reshape(height, 4)
    weights = x_weights.astype(np.int32)[None, :, :, None]
    rows = np.empty((len(needed), width * cn), dtype=np.int64)  # horizontal pass, exact integers
    for start in range(0, len(needed), _ROW_CHUNK):
        block = image[needed[start : start + _ROW_CHUNK]]
        acc = np.zeros((block.shape[0], width, cn), dtype=np.int32)  # |sum| < 2**21
        for k in range(4):
            acc += block[:, x_index[:, k], :].astype(np.int32) * weights[:, :, k]
        rows[start : start + _ROW_CHUNK] = acc.reshape(block.shape[0], width * cn)
    n = width * cn
    vec = (n // _SIMD_I16_LANES) * _SIMD_I16_LANES
    out = np.empty((height, n), dtype=np.int64)
    scale = np.float32(1.0 / (_COEF_SCALE * _COEF_SCALE))
    for start in range(0, height, _ROW_CHUNK):
        idx = y_index[start : start + _ROW_CHUNK]
        beta = y_weights[start : start + _ROW_CHUNK]
        taps = rows[idx]  # (rows, 4, n)
        fixed = (taps * beta[:, :, None]).sum(axis=1)
        block = (fixed + (1 << (2 * _COEF_BITS - 1))) >> (2 * _COEF_BITS)
        if vec:
            bf = (beta.astype(np.float32) * scale)[:, :, None]
            t = taps[:, :, :vec].astype(np.float32)
            acc = t[:, 3] * bf[:, 3]
            acc = t[:, 2] * bf[:, 2] + acc
            acc = t[:, 1] * bf[:, 1] + acc
            acc = t[:, 0] * bf[:, 0] + acc
            block[:, :vec] = np.rint(acc).astype(np.int64)
        out[start : start + _ROW_CHUNK] = block
    return np.clip(out, 0, 255).astype(np.uint8).reshape(height, width, cn)


def _area_taps(src: int, dst: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """OpenCV's computeResizeAreaTab as (dst, taps) index and float32 weight arrays."""
    taps: list[list[tuple[int, float]]] = []
    for d in range(dst):
        fs1 = d * scale
        fs2 = fs1 + scale
        cell = min(scale, src - fs1)
        s2 = min(int(np.floor(fs2)), src - 1)
        s1 = min(int(np.ceil(fs1)), s2)
        row: list[tuple[int, float]] = []
        if s1 - fs1 > 1e-3:
            row.append((s1 - 1, (s1 - fs1) / cell))
        row.extend((s, 1.0 / cell) for s in range(s1, s2))
        if fs2 - s2 > 1e-3:
            row.append((s2, min(min(fs2 - s2, 1.0), cell) / cell))
        taps.append(row)
    width = max(len(r) for r in taps)
    index = np.zeros((dst, width), dtype=np.int64)
    weight = np.zeros((dst, width), dtype=np.float32)  # padding taps weigh 0: adding 0.0 is exact
    for d, row in enumerate(taps):
        for k, (s, a) in enumerate(row):
            index[d, k] = s
            weight[d, k] = np.float32(a)
    return index, weight


def _resize_area_fractional(image: np.ndarray, width: int, height: int) -> np.ndarray:
    h, w, cn = image.shape
    x_index, x_weight = _area_taps(w, width, 1.0 / (width / w))
    y_index, y_weight = _area_taps(h, height, 1.0 / (height / h))
    src = image.astype(np.float32)
    rows = np.zeros((h, width, cn), dtype=np.float32)
    for k in range(x_index.shape[1]):  # OpenCV adds the taps of a cell left to right
        rows = rows + src[:, x_index[:, k], :] * x_weight[None, :, k, None]
    total = np.zeros((height, width, cn), dtype=np.float32)
    for k in range(y_index.shape[1]):  # and the rows of a cell top to bottom
        total = total + y_weight[:, k, None, None] * rows[y_index[:, k]]
    return np.clip(np.rint(total), 0, 255).astype(np.uint8)


def _resize_area_integer(image: np.ndarray, fx: int, fy: int) -> np.ndarray:
    h, w, cn = image.shape
    width, height = w // fx, h // fy
    blocks = image.astype(np.int64).reshape(height, fy, width, fx, cn)
    sums = blocks.sum(axis=(1, 3)).reshape(height, width * cn)
    out = np.rint(sums.astype(np.float32) * np.float32(1.0 / (fx * fy)))
    if (fx, fy) == (2, 2) and cn in (1, 3, 4):
        step = _SIMD_U8_LANES * (3 if cn == 3 else 1)
        vec = (width * cn // step) * step
        out[:, :vec] = (sums[:, :vec] + 2) >> 2
    return np.clip(out, 0, 255).astype(np.uint8).reshape(height, width, cn)


def resize_area(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """OpenCV `resize(..., INTER_AREA)` for shrinking an HWC uint8 image (no side grows)."""
    h, w, _ = image.shape
    if (w, h) == (width, height):
        return image.copy()
    if width > w or height > h:
        raise ValueError("resize_area only shrinks")
    if w % width == 0 and h % height == 0:
        return _resize_area_integer(image, w // width, h // height)
    return _resize_area_fractional(image, width, height)
