"""Checkpoint loading: clear errors for bad checkpoints, the rope layout option, recipe selection."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.loader.load import iter_safetensors, load_model
from deepinfer.model.registry import model_class
from deepinfer.recipe import ModelInfo, Recipe, resolve_family
from tests.deepseek.tiny_checkpoint import build_checkpoint


def _fresh_model(checkpoint, **config_overrides):
    config = ModelConfig.from_hf({**checkpoint.config, **config_overrides})
    return model_class(config.model_type).from_config(config)


def _weights(checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    return iter_safetensors(checkpoint.path)


def test_registered_model_types():
    for model_type in ("deepseek_v3", "deepseek_v32", "deepseek_v2"):
        assert model_class(model_type).__name__ == "DeepseekV3ForCausalLM"


def test_unexpected_weight_is_named(v3_ckpt):
    extra = ("model.layers.0.self_attn.bogus.weight", torch.zeros(2, 2))
    with pytest.raises(KeyError, match=re.escape(extra[0])):
        _fresh_model(v3_ckpt).load_weights([*_weights(v3_ckpt), extra])


def test_missing_expert_is_reported(v3_ckpt):
    dropped = "model.layers.1.mlp.experts.5.up_proj.weight"
    weights = [(n, t) for n, t in _weights(v3_ckpt) if n != dropped]
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.experts\.w13 \(93% loaded\)"):
        _fresh_model(v3_ckpt).load_weights(weights)


def test_shape_mismatch_names_the_tensor(v3_ckpt):
    """A config that disagrees with the checkpoint fails on the first mismatching tensor."""
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.self_attn\.kv_b_proj\.weight.*shape"):
        _fresh_model(v3_ckpt, v_head_dim=16).load_weights(_weights(v3_ckpt))


def test_duplicate_weight_is_an_error(v3_ckpt):
    weights = list(_weights(v3_ckpt))
    with pytest.raises(ValueError, match="appears twice"):
        _fresh_model(v3_ckpt).load_weights([*weights, weights[0]])


def test_unsupported_quantization_is_refused(v3_ckpt):
    with pytest.raises(ValueError, match="quant_method='awq'"):
        _fresh_model(v3_ckpt, quantization_config={"quant_method": "awq"})


def test_router_stays_float32_in_bfloat16(v3_ckpt):
    model = load_model(str(v3_ckpt.path), torch.bfloat16, torch.device("cpu")).model
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].self_attn.kv_b_proj.dtype == torch.bfloat16


def test_rope_without_interleave_matches_hf(tmp_path):
    """rope_interleave=false (HF's half-split layout): no row reordering at load."""
    checkpoint = build_checkpoint(
        tmp_path, {"rope_interleave": False, "num_nextn_predict_layers": 0}, fp8=False, seed=5
    )
    model = load_model(str(checkpoint.path), torch.float32, torch.device("cpu")).model
    from deepinfer.attention.metadata import AttentionMetadata, ForwardMetadata

    ids = [0, 11, 23, 57, 101, 250, 3, 77]
    group = AttentionMetadata(
        slot_mapping=torch.arange(8),
        block_tables=torch.tensor([[0]]),
        seq_lens=torch.tensor([8]),
        query_lens=[8],
        seq_lens_list=[8],
        num_decodes=0,
        block_size=16,
    )
    meta = ForwardMetadata([group])
    caches = [torch.zeros(16, model.arch.latent_dim) for _ in model.layers]
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(8), caches, meta, None))
        theirs = checkpoint.hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_recipe_family_from_the_checkpoint(v3_ckpt, v32_ckpt):
    """A template-less deepseek_v3 checkpoint speaks V3.2's DSML by default; V3.1 and R1 are chosen
    explicitly; deepseek_v32 checkpoints are V3.2."""
    assert json.loads((v3_ckpt.path / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert resolve_family(ModelInfo.from_hf_dir(v3_ckpt.path)) == "deepseek_v32"
    assert resolve_family(ModelInfo.from_hf_dir(v32_ckpt.path)) == "deepseek_v32"
    for family in ("deepseek_v31", "deepseek_r1"):
        assert Recipe.for_model(ModelInfo.from_hf_dir(v3_ckpt.path, family=family)).family == family


def test_missing_config_key_is_named(v3_ckpt):
    config = {k: v for k, v in v3_ckpt.config.items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="'kv_lora_rank' is required"):
        model_class("deepseek_v3").from_config(ModelConfig.from_hf(config))
