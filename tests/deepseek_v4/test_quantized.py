"""FP8 (e8m0 128x128 block scales) and MXFP4 (e2m1 + e8m0 per 32) checkpoints in DeepSeek's format.

The checkpoint's config.json is DeepSeek's published dialect (compress_ratios, num_hash_layers,
qk_rope_head_dim, rope_scaling, expert_dtype fp4). Every dequantized weight equals a tile-by-tile /
element-by-element reference written in the test, and the model, run in fp32, matches HF's on the
same dequantized weights; in bf16 it runs and keeps its mixing weights, norms, sinks and router in
float32.
"""

from __future__ import annotations

import re

import torch
from safetensors import safe_open

from deepinfer.model.loader.load import load_model
from tests.deepseek_v4.conftest import CachedRun


def _loaded_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The model's copy of the checkpoint weight `name` (expert rows out of the stacked tensors)."""
    params = dict(model.named_parameters())
    if name.startswith("mtp.0.") and not name.startswith(("mtp.0.e_proj", "mtp.0.h_proj")):
        name = "mtp.0.block." + name.removeprefix("mtp.0.")
    expert = re.fullmatch(r"(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight", name)
    shared = re.fullmatch(r"(.*\.ffn)\.shared_experts\.(w[123])\.weight", name)
    if expert is not None:
        ffn, number, kind = expert.group(1), int(expert.group(2)), expert.group(3)
        if kind == "w2":
            return params[f"{ffn}.experts.w2"][number]
        stacked = params[f"{ffn}.experts.w13"][number]
    elif shared is not None:
        ffn, kind = shared.group(1), shared.group(2)
        if kind == "w2":
            return params[f"{ffn}.shared_experts.down_proj"]
        stacked = params[f"{ffn}.shared_experts.gate_up_proj"]
    else:
        return params[name.removesuffix(".weight")]
    half = stacked.shape[0] // 2
    return stacked[:half] if kind == "w1" else stacked[half:]


def test_checkpoint_really_is_fp8_and_mxfp4(quantized):
    dtypes = {}
    for file in sorted(quantized.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                dtypes[name] = f.get_slice(name).get_dtype()
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.experts.3.w2.weight"] == "I8"
    assert dtypes["layers.0.ffn.experts.3.w2.scale"] == "F8_E8M0"
    assert dtypes["mtp.0.e_proj.weight"] == "F8_E4M3"
    assert dtypes["layers.2.attn.compressor.wkv.weight"] == "F32"  # compressors stay unquantized


def test_dequantized_weights_equal_reference(quantized):
    model = load_model(quantized.path, torch.float32, torch.device("cpu")).model
    assert any(".experts." in n for n in quantized.references)
    assert any(".attn.wq_b" in n for n in quantized.references)
    for name, expected in quantized.references.items():
        assert torch.equal(_loaded_weight(model, name), expected), name


def test_quantized_model_matches_hf_on_dequantized_weights(quantized):
    model = load_model(quantized.path, torch.float32, torch.device("cpu")).model
    ids = torch.randint(3, quantized.config["vocab_size"], (40,), generator=torch.Generator().manual_seed(9))
    run = CachedRun(model)
    (ours,) = run.logits({run.new_sequence(): ids.tolist()})
    with torch.no_grad():
        expected = quantized.hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_bf16_load_runs_with_fp32_mixing_and_routing(quantized):
    model = load_model(quantized.path, torch.bfloat16, torch.device("cpu")).model
    params = dict(model.named_parameters())
    for name in (
        "layers.1.hc_attn.fn",
        "hc_head.fn",
        "layers.1.attn.attn_sink",
        "layers.1.attn.compressor.ape",
        "layers.1.ffn.gate.weight",
        "layers.1.ffn.gate.bias",
        "layers.1.attn.kv_norm.weight",
        "norm.weight",
    ):
        assert params[name].dtype == torch.float32, name
    assert params["layers.1.attn.wq_b"].dtype == torch.bfloat16
    ids = torch.randint(3, quantized.config["vocab_size"], (12,), generator=torch.Generator().manual_seed(10))
    cached = CachedRun(model)
    cached.cache.dtype = torch.bfloat16
    (logits,) = cached.logits({cached.new_sequence(): ids.tolist()})
    with torch.no_grad():
        expected = quantized.hf(ids[None]).logits[0]
    assert torch.isfinite(logits).all()
    assert (logits.float().argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
