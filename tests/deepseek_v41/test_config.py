"""DeepSeek-V4.1 config.json: what parses, and that every malformed key is named."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from deepinfer.model.deepseek_v4.v41_config import (
    CandidateBlocks,
    DeepseekV41Arch,
    engram_table_sizes,
    next_prime,
)
from tests.deepseek_v41.tiny_v41 import engram_rows, tiny_config


def test_tiny_config_parses_to_its_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    arch = DeepseekV41Arch.from_file(tmp_path)
    assert (arch.num_layers, arch.hidden_size, arch.head_dim, arch.kv_lora_rank) == (6, 64, 96, 32)
    assert arch.compress_ratios == (0, 2, 2, 1, 1, 1)
    assert arch.yoco_boundary == 3
    assert arch.kv_source == (0, 1, 1, 3, 3, 3)
    assert arch.index_source == (0, 1, 2, 3, 3, 5)
    assert arch.index_k_source == (0, 1, 1, 3, 3, 3)
    assert [arch.owns_compressor(i) for i in range(6)] == [False, True, False, True, False, False]
    assert [arch.owns_indexer(i) for i in range(6)] == [False, True, True, True, False, True]
    assert [arch.owns_index_keys(i) for i in range(6)] == [False, True, False, True, False, False]
    assert arch.candidate == CandidateBlocks(source_layer=3, topk_blocks=8, block_size=4)
    assert arch.hc_shifted and arch.hc_mult == 2 and arch.hc_sinkhorn_iters == 20
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.num_shared_experts) == (4, 2, 1)
    assert arch.moe.routed_scaling_factor == 1.5
    assert arch.yarn is not None and arch.yarn.factor == 4.0
    d = arch.dspark
    assert (d.num_layers, d.block_size, d.target_layer_ids, d.markov_rank) == (2, 4, (1, 4), 8)
    assert (d.noise_token_id, d.pad_token_id, d.moe.num_experts, d.moe.top_k) == (5, 2, 2, 1)
    assert arch.compress_ratio(6) == 0  # DSpark layers attend through the sliding window
    e = arch.engram
    assert e is not None and e.layer_ids == (1, 4) and e.head_dim == 32 and e.compressed_vocab_size is None
    # Primes at or above 50, distinct across every head, table and layer, in that order.
    assert e.layer_table_sizes(1) == ((53, 59), (61, 67))
    assert e.layer_table_sizes(4) == ((71, 73), (79, 83))
    assert {layer: e.layer_rows(layer) for layer in e.layer_ids} == engram_rows(tiny_config()["text_config"])
    v = arch.vision
    assert (v.hidden_size, v.downsample_ratio, v.patch_size) == (48, 2, 14)
    assert (v.num_layers, v.num_heads, v.head_dim, v.intermediate_size) == (2, 4, 12, 64)
    assert arch.fp8_block == (32, 32)
    with pytest.raises(AttributeError):
        arch.num_layers = 3  # frozen


def test_defaults_and_switches():
    raw = tiny_config(candidate_source_layer_id=None, engram_layer_ids=[], hc_shifted=False)
    del raw["text_config"]["index_k_source_layer_ids"]  # defaults to the KV sources
    arch = DeepseekV41Arch.from_raw(raw)
    assert arch.index_k_source == arch.kv_source
    assert arch.candidate is None and arch.engram is None and not arch.hc_shifted


def test_yoco_boundary_in_a_dspark_layer_turns_yoco_off():
    raw = tiny_config(compress_ratios=[0, 2, 2, 2, 2, 2, 1, 0], candidate_source_layer_id=None)
    assert DeepseekV41Arch.from_raw(raw).yoco_boundary is None


def test_primes():
    assert [next_prime(n) for n in (0, 1, 2, 13, 89, 7919)] == [2, 2, 3, 17, 97, 7927]
    assert next_prime(10**12) == 1_000_000_000_039
    sizes = engram_table_sizes(2, 2, 8, 1_000_000)
    flat = [p for layer in sizes for table in layer for p in table]
    assert len(set(flat)) == len(flat) == 32 and min(flat) >= 1_000_000


def _set(path: str, value: Any):
    def apply(raw: dict[str, Any]) -> None:
        *parents, key = path.split(".")
        node = raw
        for part in parents:
            node = node[part]
        if value is _DELETE:
            del node[key]
        else:
            node[key] = value

    return apply


_DELETE = object()
_T = "text_config."

MALFORMED = [
    ("architectures", ["DeepseekV4ForCausalLM"], "architectures"),
    ("model_type", "deepseek_v4", "model_type"),
    ("dtype", "float16", "dtype"),
    ("quantization_config.weight_block_size", [128, 128], "quantization_config.weight_block_size"),
    ("quantization_config.scale_fmt", None, "quantization_config.scale_fmt"),
    ("quantization_config.expert_dtype", "fp8", "quantization_config.expert_dtype"),
    ("quantization_config.quant_method", "awq", "quantization_config.quant_method"),
    ("quantization_config.activation_scheme", "static", "quantization_config.activation_scheme"),
    ("vision_config", _DELETE, "vision_config"),
    ("vision_config.downsample_ratio", 0, "vision_config.downsample_ratio"),
    ("vision_config.patch_size", _DELETE, "vision_config.patch_size"),
    ("vision_config.patch_size", 16, "vision_config.patch_size"),
    ("vision_config.num_attention_heads", 5, "vision_config.num_attention_heads"),  # 48 / 5
    ("vision_config.num_attention_heads", 8, "vision_config.num_attention_heads"),  # heads of 6
    ("vision_config.num_hidden_layers", 0, "vision_config.num_hidden_layers"),
    ("vision_config.intermediate_size", "64", "vision_config.intermediate_size"),
    ("pad_token_id", _DELETE, "pad_token_id"),
    (_T + "hidden_act", "gelu", _T + "hidden_act"),
    (_T + "num_key_value_heads", 4, _T + "num_key_value_heads"),
    (_T + "attention_bias", True, _T + "attention_bias"),
    (_T + "hidden_size", "64", _T + "hidden_size"),
    (_T + "num_hidden_layers", 0, _T + "num_hidden_layers"),
    (_T + "compress_ratios", [0, 2, 2, 1, 1, 1, 0], _T + "compress_ratios"),  # one entry short
    (_T + "compress_ratios", [0, 4, 4, 1, 1, 1, 0, 0], _T + "compress_ratios"),  # V4's CSA rate
    (_T + "compress_ratios", [0, 2, 2, 128, 1, 1, 0, 0], _T + "compress_ratios"),  # V4's HCA rate
    (_T + "compress_ratios", [0, 2, 2, 2, 2, 2, 0, 0], _T + "compress_ratios"),  # no YoCo boundary
    (_T + "compress_ratios", "0,2,2", _T + "compress_ratios"),
    (_T + "qk_rope_head_dim", 32, _T + "qk_rope_head_dim"),
    (_T + "head_dim", 64, _T + "head_dim"),
    (_T + "o_groups", 3, _T + "o_groups"),
    (_T + "index_head_dim", 32, _T + "index_head_dim"),
    (_T + "index_topk", 0, _T + "index_topk"),
    (_T + "kv_source_layer_ids", [], _T + "kv_source_layer_ids"),
    (_T + "kv_source_layer_ids", [1, 9], _T + "kv_source_layer_ids"),
    (_T + "kv_source_layer_ids", [0], _T + "kv_source_layer_ids"),  # sliding layer 0 as a source
    (_T + "kv_source_layer_ids", [1, 4], _T + "kv_source_layer_ids"),  # crosses the YoCo boundary
    (_T + "kv_source_layer_ids", [1], _T + "kv_source_layer_ids"),  # C1 layer 3 sharing C2 layer 1
    (_T + "index_source_layer_ids", [1, 4], _T + "index_source_layer_ids"),  # C1 layer 3 from C2 layer 1
    (_T + "index_source_layer_ids", None, _T + "index_source_layer_ids"),
    (_T + "kv_source_layer_ids", [1, 2, 3], _T + "index_k_source_layer_ids"),  # index-K wider than KV
    (_T + "index_k_source_layer_ids", [1, 1, 3], _T + "index_k_source_layer_ids"),
    (_T + "candidate_source_layer_id", _DELETE, _T + "candidate_source_layer_id"),
    (_T + "candidate_source_layer_id", 0, _T + "candidate_source_layer_id"),  # sliding
    (_T + "candidate_source_layer_id", 4, _T + "candidate_source_layer_id"),  # not an indexer
    (_T + "candidate_source_layer_id", 1, _T + "candidate_source_layer_id"),  # later C1 layers
    (_T + "candidate_source_layer_id", 6, _T + "candidate_source_layer_id"),
    (_T + "candidate_topk_blocks", 12, _T + "candidate_topk_blocks"),
    (_T + "candidate_block_size", 32, _T + "candidate_block_size"),
    (_T + "index_topk", 64, _T + "candidate_topk_blocks"),  # more than the candidates hold
    (_T + "hc_mult", 1, _T + "hc_mult"),  # Engram needs two streams
    (_T + "hc_shifted", "yes", _T + "hc_shifted"),
    (_T + "hc_eps", 0, _T + "hc_eps"),
    (_T + "hc_sinkhorn_iters", _DELETE, _T + "hc_sinkhorn_iters"),
    (_T + "scoring_func", "softmax", _T + "scoring_func"),
    (_T + "topk_method", "greedy", _T + "topk_method"),
    (_T + "norm_topk_prob", False, _T + "norm_topk_prob"),
    (_T + "num_experts_per_tok", 5, _T + "num_experts_per_tok"),
    (_T + "n_shared_experts", -1, _T + "n_shared_experts"),
    (_T + "moe_intermediate_size", _DELETE, _T + "moe_intermediate_size"),
    (_T + "routed_scaling_factor", "x", _T + "routed_scaling_factor"),
    (_T + "dspark_num_experts_per_tok", 3, _T + "dspark_num_experts_per_tok"),
    (_T + "dspark_block_size", 0, _T + "dspark_block_size"),
    (_T + "dspark_target_layer_ids", [1, 6], _T + "dspark_target_layer_ids"),
    (_T + "dspark_target_attn_input", False, _T + "dspark_target_attn_input"),
    (_T + "dspark_markov_rank", _DELETE, _T + "dspark_markov_rank"),
    (_T + "dspark_noise_token_id", -1, _T + "dspark_noise_token_id"),
    (_T + "engram_layer_ids", [1, 7], _T + "engram_layer_ids"),
    (_T + "engram_max_ngram_size", 1, _T + "engram_max_ngram_size"),
    (_T + "engram_vocab_size", _DELETE, _T + "engram_vocab_size"),
    (_T + "engram_n_heads", 0, _T + "engram_n_heads"),
    (_T + "engram_head_dim", 1.5, _T + "engram_head_dim"),
    (_T + "engram_pad_token_id", _DELETE, _T + "engram_pad_token_id"),
    (_T + "rope_scaling", {"factor": 4.0}, _T + "rope_scaling.original_max_position_embeddings"),
]


@pytest.mark.parametrize(
    ("path", "value", "named"), MALFORMED, ids=[f"{p}={v!r}"[:60] for p, v, _ in MALFORMED]
)
def test_malformed_key_is_named(path, value, named):
    raw = copy.deepcopy(tiny_config())
    _set(path, value)(raw)
    with pytest.raises(ValueError, match=f"config.json: {named}\\b"):
        DeepseekV41Arch.from_raw(raw)


def test_top_k_segments_must_lie_inside_index_key_segments():
    raw = tiny_config(index_source_layer_ids=[1, 3, 5], index_k_source_layer_ids=[1, 2, 3])
    with pytest.raises(
        ValueError, match=r"text_config\.index_source_layer_ids must refine text_config\.index_k"
    ):
        DeepseekV41Arch.from_raw(raw)


def test_invalid_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        DeepseekV41Arch.from_file(tmp_path / "config.json")
