"""V4.1 image preprocessing against DeepSeek's own codec (`deepseek-recipe` 0.2.0).

For each generated image the codec's `OpenCvImagePreprocessor` gives the picture it hands the
engine (a WebP) and its size; `MultiModalData.image_token_adjustment` gives its token count.
Ours must give the same size, the same WebP bytes (so the same decoded pixels; the pixels are
also compared, within 1/255) and the same token count. Bad inputs must be refused by both, ours
with an error naming the part.
"""

from __future__ import annotations

import base64
import io
import random
import zlib

import numpy as np
import pytest
from PIL import Image

from deepinfer.recipe.images import ImageInputError, count_tokens, fit_image, preprocess
from deepinfer.recipe.images.decode import MAX_IMAGE_BYTES, bytes_from_data_url, decode_base64
from deepinfer.recipe.images.geometry import MAX_TOKENS

deepseek_recipe = pytest.importorskip("deepseek_recipe")

WHERE = "messages[0].content[1]"


def _noise(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _smooth(width: int, height: int, seed: int) -> np.ndarray:
    """Gradients with some texture: what JPEG and lossy WebP inputs look like."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x * 7 + y * 3) % 256], -1)
    return (base + rng.integers(-12, 12, base.shape)).clip(0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **options)
    return buffer.getvalue()


def _codec(data: bytes, detail: str) -> tuple[object, int]:
    options = deepseek_recipe.PreprocessOptions(detail, 8192, 512)
    info = deepseek_recipe.OpenCvImagePreprocessor().preprocess(data, options)
    tokens = deepseek_recipe.MultiModalData([info]).image_token_adjustment() + 1
    return info, tokens


# (width, height, detail, format): tiny, huge, extreme aspect ratios (up to the 16380-pixel
# side), sizes whose contain/centre rounding is odd, integer and fractional low-detail shrinks.
CASES = [
    (1, 1, "high", "PNG"),
    (2, 3, "low", "PNG"),
    (50, 51, "high", "PNG"),
    (99, 77, "auto", "JPEG"),
    (101, 333, "original", "WEBP"),
    (600, 601, "high", "PNG"),
    (777, 555, "low", "JPEG"),
    (1000, 701, "low", "PNG"),
    (1024, 768, "low", "WEBP"),
    (1030, 2060, "low", "PNG"),
    (1111, 999, "original", "JPEG"),
    (1234, 77, "high", "PNG"),
    (3000, 2000, "high", "JPEG"),
    (3000, 2000, "low", "WEBP"),
    (4000, 3000, "auto", "PNG"),
    (8192, 64, "high", "PNG"),
    (64, 8192, "low", "JPEG"),
    (1, 1571, "high", "PNG"),
    (2988, 1, "original", "PNG"),
    (5, 3000, "high", "WEBP"),
    (1296, 14, "high", "PNG"),
    (2242, 14, "auto", "JPEG"),
]


@pytest.mark.parametrize(("width", "height", "detail", "fmt"), CASES)
def test_preprocessing_matches_the_codec(width: int, height: int, detail: str, fmt: str) -> None:
    noisy = fmt == "PNG" and width * height <= 2_000_000  # noise would not compress under 32 MiB
    pixels = _noise(width, height, width * 7 + height) if noisy else _smooth(width, height, width + height)
    data = _encode(pixels, fmt)
    info, tokens = _codec(data, detail)
    ours = preprocess(data, detail, WHERE)
    assert (ours.layout.width, ours.layout.height) == (info.width, info.height)
    assert ours.pixels.shape == (info.height, info.width, 3)
    assert ours.num_tokens == tokens
    assert ours.webp == info.data
    theirs = np.asarray(Image.open(io.BytesIO(info.data)).convert("RGB"), dtype=np.int16)
    assert np.abs(theirs - ours.pixels.astype(np.int16)).max() <= 1


def test_exif_orientation_is_ignored_like_the_codec() -> None:
    """A JPEG tagged 'rotate 90' keeps its stored grid: the codec's decoder ignores the tag."""
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _encode(_smooth(600, 300, 1), "JPEG", exif=exif.tobytes(), quality=95)
    info, tokens = _codec(data, "high")
    ours = preprocess(data, "high", WHERE)
    assert (ours.layout.width, ours.layout.height) == (info.width, info.height) == (770, 392)
    assert ours.webp == info.data and ours.num_tokens == tokens


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [
        ("L", "PNG"),
        ("P", "PNG"),
        ("1", "PNG"),
        ("L", "JPEG"),
        ("P", "GIF"),
        ("I;16", "PNG"),
        ("CMYK", "JPEG"),
    ],
)
def test_other_pixel_formats_match_the_codec(mode: str, fmt: str) -> None:
    rgb = _noise(120, 90, 5)
    if mode == "I;16":
        image = Image.fromarray(rgb[:, :, 0].astype(np.uint16) * 257 + np.uint16(100))
    else:
        image = Image.fromarray(rgb).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    info, tokens = _codec(buffer.getvalue(), "high")
    ours = preprocess(buffer.getvalue(), "high", WHERE)
    assert ours.webp == info.data and ours.num_tokens == tokens


def test_transparency_is_shown_over_white_like_the_codec() -> None:
    """Same size and tokens; the codec's compositing rounds differently, so pixels are close
    (a few levels after WebP), not identical (docs/recipe.md)."""
    rgba = np.random.default_rng(3).integers(0, 256, (90, 120, 4), dtype=np.uint8)
    data = _encode(rgba, "PNG")
    info, tokens = _codec(data, "high")
    ours = preprocess(data, "high", WHERE)
    assert (ours.layout.width, ours.layout.height, ours.num_tokens) == (info.width, info.height, tokens)
    theirs = np.asarray(Image.open(io.BytesIO(info.data)).convert("RGB"), dtype=np.int16)
    assert np.abs(theirs - ours.pixels.astype(np.int16)).mean() < 3


def test_token_counts_match_the_codec_over_many_sizes() -> None:
    rng = random.Random(0)
    sizes = [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(3000)]
    sizes += [(rng.randint(1, 50), rng.randint(1, 20000)) for _ in range(1000)]
    sizes += [(rng.randint(1, 20000), rng.randint(1, 50)) for _ in range(1000)]
    sizes += [(rng.randint(1, 700), rng.randint(1, 700)) for _ in range(1000)]
    for width, height in sizes:
        info = deepseek_recipe.ImageInfo(b"", width, height)
        expected = deepseek_recipe.MultiModalData([info]).image_token_adjustment() + 1
        assert count_tokens(width, height) == expected, (width, height)
        assert count_tokens(width, height) <= MAX_TOKENS


def test_token_layout_rows_end_with_a_newline_and_the_image_is_framed() -> None:
    layout = fit_image(3000, 2000)  # 1568 x 1050 pixels: 112 x 75 patches, 38 x 25 tokens
    assert (layout.patch_cols, layout.patch_rows, layout.cols, layout.rows) == (112, 75, 38, 25)
    assert layout.num_tokens == 25 * (38 + 1) + 2 == 977
    several = [fit_image(w, h) for w, h in [(100, 80), (3000, 2000), (1, 5000)]]
    infos = [deepseek_recipe.ImageInfo(b"", x.width, x.height) for x in several]
    adjustment = deepseek_recipe.MultiModalData(infos).image_token_adjustment()
    assert sum(x.num_tokens - 1 for x in several) == adjustment


def test_patches_are_normalised_in_scanline_order() -> None:
    image = preprocess(_encode(_noise(30, 20, 2), "PNG"), "high", WHERE)
    patches = image.patches()
    rows, cols = image.layout.patch_rows, image.layout.patch_cols
    assert patches.shape == (rows * cols, 3, 14, 14) and patches.dtype == np.float32
    k = 1 * cols + 2  # patch row 1, column 2
    expected = (image.pixels[14:28, 28:42].astype(np.float32) / 255 - 0.5) / 0.5
    np.testing.assert_allclose(patches[k], expected.transpose(2, 0, 1), rtol=0, atol=1e-6)
    assert patches.min() >= -1.0 and patches.max() <= 1.0


# ---------------------------------------------------------------- bad inputs, refused by both


def _codec_refuses(data: bytes) -> str:
    resolver = deepseek_recipe.ImageResolver(
        deepseek_recipe.ReqwestImageFetcher(), deepseek_recipe.OpenCvImagePreprocessor()
    )
    with pytest.raises(deepseek_recipe.ImageError) as refused:
        resolver.resolve([deepseek_recipe.BytesImageSource(data)], deepseek_recipe.ImageQuota())
    return refused.value.kind


def _refused(data: bytes) -> ImageInputError:
    with pytest.raises(ImageInputError) as refused:
        preprocess(data, "high", WHERE)
    assert refused.value.param == WHERE and str(refused.value).startswith(WHERE + ": ")
    return refused.value


def test_truncated_base64_is_refused() -> None:
    text = base64.b64encode(_encode(_noise(40, 40, 1), "PNG")).decode()
    with pytest.raises(ImageInputError, match="base64") as refused:
        bytes_from_data_url(f"data:image/png;base64,{text[:-3]}", WHERE)
    assert refused.value.param == WHERE


def test_truncated_image_is_refused() -> None:
    data = _encode(_noise(40, 40, 1), "PNG")
    cut = base64.b64decode(base64.b64encode(data)[: len(data) // 2 * 4 // 3 // 4 * 4])
    _codec_refuses(cut)
    assert "truncated" in str(_refused(cut)) or "not a PNG" in str(_refused(cut))


def test_non_image_payload_is_refused() -> None:
    _codec_refuses(b"%PDF-1.4 not an image at all")
    assert "not a PNG, JPEG, GIF or WebP" in str(_refused(b"%PDF-1.4 not an image at all"))
    with pytest.raises(ImageInputError, match="unsupported image type"):
        bytes_from_data_url("data:text/plain;base64,aGVsbG8=", WHERE)


def test_one_by_100000_image_is_refused() -> None:
    data = _encode(np.zeros((100000, 1, 3), dtype=np.uint8), "PNG")
    assert _codec_refuses(data) == "ImageDimensionsTooLarge"
    assert "1x100000" in str(_refused(data))


def test_image_over_the_size_limit_is_refused() -> None:
    data = _encode(np.zeros((8, 8, 3), dtype=np.uint8), "PNG") + b"\0" * MAX_IMAGE_BYTES
    assert _codec_refuses(data) == "ImageTooLarge"
    assert "larger than 32 MiB" in str(_refused(data))
    with pytest.raises(ImageInputError, match="larger than 32 MiB"):
        decode_base64("A" * (MAX_IMAGE_BYTES // 3 * 4 + 8), WHERE)


def test_empty_image_and_unknown_detail_are_refused() -> None:
    assert _codec_refuses(b"") == "EmptyImage"
    assert "empty" in str(_refused(b""))
    with pytest.raises(ImageInputError, match="detail"):
        preprocess(_encode(_noise(4, 4, 1), "PNG"), "medium", WHERE)


def test_empty_data_url_and_pixel_bomb_are_refused() -> None:
    with pytest.raises(ImageInputError, match="empty"):
        bytes_from_data_url("data:image/png;base64,", WHERE)
    # A PNG header claiming 100000 x 100000 pixels: refused from the header, nothing decoded.
    png = _encode(np.zeros((1, 1, 3), dtype=np.uint8), "PNG")
    ihdr = b"IHDR" + (100000).to_bytes(4, "big") * 2 + png[24:29]
    bomb = png[:12] + ihdr + zlib.crc32(ihdr).to_bytes(4, "big") + png[33:]
    assert "8192 pixels a side" in str(_refused(bomb))
