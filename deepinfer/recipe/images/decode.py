"""Image bytes from a request (base64, data URL) and the RGB pixels in them, within limits.

What is accepted is what DeepSeek's codec accepts: PNG, JPEG, GIF (the first frame) and WebP, at
most 32 MiB encoded and 8192 pixels a side. EXIF orientation is not applied, as the codec does
not apply it (its OpenCV decoder ignores the tag), so the model sees the stored pixel grid.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import warnings

import numpy as np
from PIL import Image

from deepinfer.recipe.images.errors import ImageInputError

MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_DIMENSION = 8192
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp")


def decode_base64(data: str, where: str) -> bytes:
    """Strict base64 (whitespace allowed, as clients wrap lines); refused before decoding when
    it cannot fit the byte limit."""
    text = "".join(data.split())
    if len(text) // 4 * 3 > MAX_IMAGE_BYTES + 2:
        raise ImageInputError(where, f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(where, "the image data is not valid base64") from None


def bytes_from_data_url(url: str, where: str) -> bytes:
    """The payload of a `data:` URL (base64 or percent-encoded)."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageInputError(where, "the data URL has no ',' before its data")
    media_type, *params = header.split(";")
    if media_type and media_type.lower() not in MEDIA_TYPES:
        raise ImageInputError(where, f"unsupported image type {media_type!r} (png, jpeg, gif or webp)")
    if "base64" in (p.lower() for p in params):
        data = decode_base64(payload, where)
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    check_size(len(data), where)
    return data


def check_size(size: int, where: str) -> None:
    if size > MAX_IMAGE_BYTES:
        raise ImageInputError(where, f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
    if size == 0:
        raise ImageInputError(where, "the image is empty")


def decode_rgb(data: bytes, where: str, max_pixels: int | None = None) -> np.ndarray:
    """HWC uint8 RGB pixels of an encoded image; one of more than `max_pixels` pixels is refused
    from its header, before any pixel is decoded (a small PNG can declare gigabytes of them)."""
    check_size(len(data), where)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageInputError(where, f"the image has more than {MAX_DIMENSION} pixels a side") from None
        except (OSError, ValueError):
            raise ImageInputError(where, "not a PNG, JPEG, GIF or WebP image") from None
        width, height = image.size
        if width > MAX_DIMENSION or height > MAX_DIMENSION:
            raise ImageInputError(
                where, f"the image is {width}x{height}; at most {MAX_DIMENSION} pixels a side are accepted"
            )
        if width < 1 or height < 1:
            raise ImageInputError(where, "the image has no pixels")
        if max_pixels is not None and width * height > max_pixels:
            raise ImageInputError(
                where, f"the image is {width}x{height}, more than the {max_pixels} pixels accepted"
            )
        try:
            image.load()
            return _rgb(image)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning):
            raise ImageInputError(where, "the image data is truncated or corrupt") from None


def _rgb(image: Image.Image) -> np.ndarray:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grey scaled to 8 bits with rounding, as the codec does (Pillow's RGB conversion
        # would clip instead).
        grey = np.rint(np.asarray(image, dtype=np.float64) / 257.0).clip(0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode in ("RGBA", "LA", "PA"):
        # Transparent pixels are shown over white, as the codec shows them (its exact rounding
        # is not reproduced: see docs/recipe.md).
        rgba = np.asarray(image.convert("RGBA"), dtype=np.int32)
        alpha = rgba[:, :, 3:]
        return ((rgba[:, :, :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    if image.mode == "CMYK":
        return _cmyk_as_opencv(image)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _cmyk_as_opencv(image: Image.Image) -> np.ndarray:
    """CMYK JPEG as the codec's OpenCV converts it (Pillow's own conversion differs by up to
    15 levels): on the values as stored, which Adobe JPEGs store inverted and Pillow un-inverts,
    each channel is k - ((255 - c) * k >> 8)."""
    values = np.asarray(image, dtype=np.int32)
    stored = 255 - values if "adobe" in image.info else values
    k = stored[:, :, 3:]
    return (k - ((255 - stored[:, :, :3]) * k >> 8)).astype(np.uint8)
