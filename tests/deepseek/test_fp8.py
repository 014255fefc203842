"""Block-FP8 dequantization: vectorized tiles against a tile-by-tile loop, and weight/scale pairing."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.layers.fp8 import dequantize_block_fp8, weight_block_size
from deepinfer.model.loader.scaled import dequantize_checkpoint
from tests.deepseek.tiny_checkpoint import dequantize_reference, quantize_block_fp8


@pytest.mark.parametrize("shape", [(300, 260), (128, 128), (7, 129), (256, 384)])
def test_dequantize_matches_tile_loop(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    quantized, scale = quantize_block_fp8(weight)
    assert quantized.dtype == torch.float8_e4m3fn
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ours = dequantize_block_fp8(quantized, scale)
    assert torch.equal(ours, dequantize_reference(quantized, scale))
    # FP8 e4m3 keeps ~2 significant digits: the round trip is close to the original weight.
    torch.testing.assert_close(ours, weight, atol=0.07 * weight.abs().max().item(), rtol=0.07)


def test_non_square_blocks_from_config():
    assert weight_block_size({}) == (128, 128)
    assert weight_block_size({"quantization_config": {"weight_block_size": [64, 32]}}) == (64, 32)
    quantized = torch.randn(100, 70).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3) + 0.5
    expected = quantized.float() * scale.repeat_interleave(64, 0)[:100].repeat_interleave(32, 1)[:, :70]
    assert torch.equal(dequantize_block_fp8(quantized, scale, (64, 32)), expected)


def test_scale_shape_must_tile_the_weight():
    quantized = torch.zeros(300, 260, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        dequantize_block_fp8(quantized, torch.ones(2, 3))


def test_pairing_in_any_order():
    """Scale before its weight, after it, with other tensors in between; unquantized pass through."""
    a, a_scale = quantize_block_fp8(torch.randn(130, 20))
    b, b_scale = quantize_block_fp8(torch.randn(40, 200))
    norm = torch.ones(20)
    stream = [
        ("x.a.weight_scale_inv", a_scale),
        ("x.norm.weight", norm),
        ("x.b.weight", b),
        ("x.a.weight", a),
        ("x.b.weight_scale_inv", b_scale),
    ]
    out = dict(dequantize_checkpoint(iter(stream)))
    assert list(out) == ["x.norm.weight", "x.a.weight", "x.b.weight"]
    assert torch.equal(out["x.norm.weight"], norm)
    assert torch.equal(out["x.a.weight"], dequantize_reference(a, a_scale))
    assert torch.equal(out["x.b.weight"], dequantize_reference(b, b_scale))
    assert out["x.a.weight"].dtype == torch.float32


def test_unpaired_halves_are_errors():
    fp8 = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"without a _scale_inv scale: \['m.w.weight'\]"):
        list(dequantize_checkpoint([("m.w.weight", fp8)]))
    with pytest.raises(ValueError, match=r"scales without their weight: \['m.w.weight_scale_inv'\]"):
        list(dequantize_checkpoint([("m.w.weight_scale_inv", torch.ones(1, 1))]))
    with pytest.raises(ValueError, match="not FP8"):
        list(
            dequantize_checkpoint(
                [("m.w.weight_scale_inv", torch.ones(1, 1)), ("m.w.weight", torch.ones(4, 4))]
            )
        )


def test_kept_weights_pass_with_their_scales():
    """A weight a layer keeps in FP8 passes as stored, then its scale; the others dequantize."""
    a, a_scale = quantize_block_fp8(torch.randn(130, 20))
    b, b_scale = quantize_block_fp8(torch.randn(40, 200))
    stream = [
        ("x.a.weight_scale_inv", a_scale),
        ("x.b.weight", b),
        ("x.a.weight", a),
        ("x.b.weight_scale_inv", b_scale),
    ]
    out = list(dequantize_checkpoint(iter(stream), keep=lambda name: name == "x.a.weight"))
    assert [name for name, _ in out] == ["x.a.weight", "x.a.weight_scale_inv", "x.b.weight"]
    assert out[0][1] is a and out[1][1] is a_scale
    assert torch.equal(out[2][1], dequantize_reference(b, b_scale))


def test_a_layer_kept_in_fp8_refuses_an_unquantized_weight(tmp_path):
    """A checkpoint that says it is FP8 but stores its weights in float32: the first kept layer
    (an o_proj or down_proj) refuses its weight rather than cast it to FP8."""
    import json

    from deepinfer.model.loader.load import load_model
    from tests.deepseek.conftest import VARIANTS
    from tests.deepseek.tiny_checkpoint import build_checkpoint

    overrides, _, seed = VARIANTS["v3"]
    checkpoint = build_checkpoint(tmp_path / "v3", overrides, fp8=False, seed=seed)
    config = json.loads((checkpoint.path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (checkpoint.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"(o_proj|down_proj).weight' is stored as torch.float32, but its layer keeps FP8"
    ):
        load_model(checkpoint.path, torch.float32, torch.device("cpu"), keep_fp8=True)
