"""Tiny random DeepSeek checkpoints (built once per session) and engines serving them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deepseek.tiny_checkpoint import TinyCheckpoint, build_checkpoint

# name -> (config overrides, FP8-quantized, seed). All stay tiny: hidden <= 128, <= 4 layers with
# MTP, vocabulary of the tokenizer (< 1024).
VARIANTS: dict[str, tuple[dict[str, Any], bool, int]] = {
    # q LoRA, YaRN (factor 8: softmax scale and cos/sin corrections), 1 dense + 2 MoE layers, MTP.
    "v3": ({}, False, 0),
    # no q LoRA, plain RoPE, FP8 128x128 block scales with partial edge tiles (q_proj 192 rows,
    # MLP 200 wide), 1 dense + 1 MoE layer, MTP.
    "v3_fp8": (
        {
            "q_lora_rank": None,
            "rope_scaling": None,
            "hidden_size": 128,
            "intermediate_size": 200,
            "moe_intermediate_size": 48,
            "v_head_dim": 32,
            "num_hidden_layers": 2,
            "n_group": 2,
            "topk_group": 1,
        },
        True,
        1,
    ),
    # DeepSeek-V2(-Lite) routing: softmax scores, group-limited greedy, no normalisation, no MTP.
    "v2": (
        {
            "model_type": "deepseek_v2",
            "architectures": ["DeepseekV2ForCausalLM"],
            "q_lora_rank": None,
            "scoring_func": "softmax",
            "topk_method": "group_limited_greedy",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "num_nextn_predict_layers": 0,
        },
        False,
        2,
    ),
    # V3.2: the checkpoint carries DSA indexer weights; with index_topk above the context, HF's
    # sparse attention is dense, which is what we run.
    "v32": (
        {
            "model_type": "deepseek_v32",
            "architectures": ["DeepseekV32ForCausalLM"],
            "index_topk": 2048,
            "index_n_heads": 2,
            "index_head_dim": 32,
        },
        False,
        3,
    ),
}


def _build(tmp_path_factory: pytest.TempPathFactory, name: str) -> TinyCheckpoint:
    overrides, fp8, seed = VARIANTS[name]
    return build_checkpoint(tmp_path_factory.mktemp(name), overrides, fp8=fp8, seed=seed)


@pytest.fixture(scope="session")
def v3_ckpt(tmp_path_factory) -> TinyCheckpoint:
    return _build(tmp_path_factory, "v3")


@pytest.fixture(scope="session")
def v3_fp8_ckpt(tmp_path_factory) -> TinyCheckpoint:
    return _build(tmp_path_factory, "v3_fp8")


@pytest.fixture(scope="session")
def v2_ckpt(tmp_path_factory) -> TinyCheckpoint:
    return _build(tmp_path_factory, "v2")


@pytest.fixture(scope="session")
def v32_ckpt(tmp_path_factory) -> TinyCheckpoint:
    return _build(tmp_path_factory, "v32")


@pytest.fixture(scope="session")
def v3_llm(v3_ckpt):
    from deepinfer import LLM

    return LLM(model=str(v3_ckpt.path), num_blocks=256, num_threads=1)
