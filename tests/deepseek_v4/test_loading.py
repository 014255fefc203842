"""Loading DeepSeek-V4 directories: transformers' own save_pretrained output, and malformed
checkpoints and configs, which fail naming the tensor or key at fault."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.loader.load import load_model
from deepinfer.model.registry import model_class
from tests.deepseek_v4.conftest import CachedRun


def _copy(tiny, directory: Path, edit_tensors=None, edit_config=None) -> Path:
    """The tiny checkpoint rewritten as one shard, with tensors and config edited."""
    directory.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(tiny.path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if edit_tensors is not None:
        edit_tensors(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((tiny.path / "config.json").read_text())
    if edit_config is not None:
        edit_config(config)
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.path / name, directory / name)
    return directory


def _load(path: Path):
    return load_model(path, torch.float32, torch.device("cpu")).model


def test_registered_for_deepseek_v4():
    assert model_class("deepseek_v4").__name__ == "DeepseekV4ForCausalLM"


def test_transformers_save_pretrained_directory_loads(tiny, tmp_path):
    """save_pretrained writes a mix of DeepSeek's names and its own (model.embed_tokens, lm_head,
    model.hc_head.hc_fn, attn.norm for kv_norm) and no MTP module: all accepted, MTP disabled."""
    directory = tmp_path / "saved"
    tiny.hf.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.path / name, directory / name)
    model = _load(directory)
    assert model.num_mtp_layers == 0
    ids = torch.randint(
        3, tiny.config["vocab_size"], (26,), generator=torch.Generator().manual_seed(11)
    ).tolist()
    run = CachedRun(model)
    (ours,) = run.logits({run.new_sequence(): ids})
    with torch.no_grad():
        torch.testing.assert_close(ours, tiny.hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)


def _drop(name):
    return lambda t: t.pop(name)


def _add(name, value):
    return lambda t: t.__setitem__(name, value)


def _reshape(name):
    return lambda t: t.__setitem__(name, torch.zeros(t[name].shape[0] + 1, *t[name].shape[1:]))


def _out_of_range_table(t):
    t["layers.0.ffn.gate.tid2eid"][5, 0] = 99


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop("layers.2.attn.compressor.ape"), "layers.2.attn.compressor.ape"),
        (_drop("layers.1.ffn.experts.5.w3.weight"), "layers.1.ffn.experts.w13 (93% loaded)"),
        (
            _add("layers.0.attn.compressor.ape", torch.zeros(4, 64)),
            "unexpected weight 'layers.0.attn.compressor.ape'",
        ),
        (_add("layers.3.ffn.experts.8.w1.weight", torch.zeros(32, 64)), "'layers.3.ffn.experts.8.w1.weight'"),
        (_add("layers.9.attn_norm.weight", torch.zeros(64)), "'layers.9.attn_norm.weight'"),
        (
            _reshape("layers.1.attn.indexer.wq_b.weight"),
            "'layers.1.attn.indexer.wq_b.weight' has shape (257, 32)",
        ),
        (_add("model.layers.0.attn_norm.weight", torch.ones(64)), "appears twice"),
        (
            _add("layers.0.attn.wq_a.scale", torch.ones(1, 1)),
            "'layers.0.attn.wq_a.weight' has a quantization scale",
        ),
        (
            _add("layers.0.attn.wkv.weight", torch.zeros(32, 32, dtype=torch.int8)),
            "'layers.0.attn.wkv.weight'",
        ),
        (_out_of_range_table, "layers.0.ffn.gate.tid2eid"),
    ],
)
def test_malformed_checkpoint_names_the_tensor(tiny, tmp_path, edit, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _load(_copy(tiny, tmp_path / "bad", edit_tensors=edit))


def test_packed_weight_outside_the_experts_is_refused(tiny, tmp_path):
    def pack_wkv(tensors):
        tensors["layers.0.attn.wkv.weight"] = torch.zeros(32, 32, dtype=torch.int8)
        tensors["layers.0.attn.wkv.scale"] = torch.ones(32, 2).to(torch.float8_e8m0fnu)

    with pytest.raises(
        ValueError, match=re.escape("'layers.0.attn.wkv.weight' is packed torch.int8 (MXFP4), which only")
    ):
        _load(_copy(tiny, tmp_path / "bad", edit_tensors=pack_wkv))


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda c: c.pop("head_dim"), "'head_dim' is required"),
        (
            _set(
                "layer_types",
                ["sliding_attention", "full_attention", "sliding_attention"] + ["sliding_attention"] * 2,
            ),
            "layer_types entries",
        ),
        (_set("layer_types", ["sliding_attention"] * 4), "layer_types must list num_hidden_layers=5"),
        (_set("mlp_layer_types", ["moe"] * 4 + ["dense"]), "mlp_layer_types entries"),
        (_set("num_key_value_heads", 2), "num_key_value_heads=2"),
        (_set("scoring_func", "tanh"), "scoring_func='tanh'"),
        (_set("o_groups", 3), "o_groups=3"),
        (_set("compress_rates", {"compressed_sparse_attention": 0}), "compress_rates"),
        (_set("quantization_config", {"quant_method": "awq"}), "quant_method='awq'"),
        (_set("expert_dtype", "int2"), "expert_dtype='int2'"),
        (_set("num_experts_per_tok", 9), "num_experts_per_tok=9"),
        (_set("rope_parameters", {"rope_type": "longrope", "factor": 2.0}), "rope type 'longrope'"),
        (_set("hidden_size", "64"), "'hidden_size' must be an integer"),
    ],
)
def test_bad_config_names_the_key(tiny, edit, key):
    config = json.loads((tiny.path / "config.json").read_text())
    edit(config)
    with pytest.raises(ValueError, match=re.escape(key)):
        DeepseekV4Arch.from_raw(config)


def test_published_dialect_rejects_unknown_compress_ratio():
    from tests.deepseek_v4.tiny_v4 import official_config

    config = official_config(500, compress_ratios=[0, 4, 16, 0])
    with pytest.raises(ValueError, match=re.escape("compress_ratios entries must be 0, 4 or 128, got [16]")):
        DeepseekV4Arch.from_raw(config)
    config = official_config(500, compress_ratios=[0, 4, 128, 4])
    with pytest.raises(ValueError, match="compress_ratios for the MTP modules must be 0"):
        DeepseekV4Arch.from_raw(config)


def test_bad_config_fails_at_load_time(tiny, tmp_path):
    with pytest.raises(ValueError, match="scoring_func='tanh'"):
        _load(_copy(tiny, tmp_path / "bad", edit_config=_set("scoring_func", "tanh")))


def test_published_flash_config_parses():
    """DeepSeek-V4-Flash's config.json as published (values as listed in docs/benchmarks.md)."""
    from deepinfer.bench.v4_kv_memory import FLASH_CONFIG

    arch = DeepseekV4Arch.from_raw(FLASH_CONFIG)
    assert arch.layer_types[:4] == (
        "sliding_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    )
    assert arch.mlp_layer_types[:4] == ("hash_moe", "hash_moe", "hash_moe", "moe")
    assert arch.rope_head_dim == 64 and arch.compress_rope.yarn["factor"] == 16
    assert arch.expert_dtype == "fp4" and arch.num_mtp_layers == 1
