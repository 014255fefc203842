"""deepinfer/bench/user_shapes.py: llama.cpp's Q4_K_M mix, valid random blocks of trained-like scale."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from deepinfer import LLM, SamplingParams
from deepinfer.bench.user_shapes import SHAPES, Shape, random_blocks, tensor_plan, write_bf16
from deepinfer.recipe import ModelInfo


def test_q4_k_m_gives_q6_k_where_llama_cpp_does():
    plan = {name: kind for name, _, kind in tensor_plan(SHAPES["llama-3.2-1b"], "Q4_K_M")}
    assert plan["token_embd.weight"] == "Q6_K"  # tied: the embedding is the LM head
    more_bits = {i for i in range(16) if plan[f"blk.{i}.attn_v.weight"] == "Q6_K"}
    assert more_bits == {0, 1, 4, 7, 10, 13, 14, 15}
    assert all(plan[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more_bits else "Q4_K") for i in range(16))
    assert plan["blk.3.attn_q.weight"] == plan["blk.0.ffn_up.weight"] == "Q4_K"
    eight_b = {name: kind for name, _, kind in tensor_plan(SHAPES["llama-3.1-8b"], "Q4_0")}
    assert eight_b["token_embd.weight"] == "Q4_0" and eight_b["output.weight"] == "Q6_K"
    qwen = {name for name, _, _ in tensor_plan(SHAPES["qwen3-1.7b"], "Q8_0")}
    assert "blk.27.attn_k_norm.weight" in qwen and "output.weight" not in qwen


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_random_blocks_decode_to_weights_of_a_trained_scale(kind):
    blocks = random_blocks(kind, 64, 2048, np.random.default_rng(0))
    values = quants.dequantize(blocks, GGMLQuantizationType[kind])
    assert values.shape == (64, 2048) and np.isfinite(values).all()
    assert 0.01 < values.std() < 0.04 and abs(values.mean()) < 0.01


def test_a_bf16_directory_serves_chat_like_a_downloaded_checkpoint(tmp_path):
    # vLLM and our chat endpoints read the template from tokenizer_config.json (or its .jinja):
    # a directory without it served no chat request, so the 32-stream peers could not run on it.
    tiny = Shape("llama", 64, 128, 2, 4, 2, 16, 49152, True, False, 10000.0, 2048)
    folder = tmp_path / "tiny-bf16"
    write_bf16(folder, tiny)
    info = ModelInfo.from_hf_dir(folder)
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 49152
    assert LLM(str(folder)).generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
