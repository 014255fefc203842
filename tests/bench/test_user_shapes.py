"""deepinfer/bench/user_shapes.py: llama.cpp's Q4_K_M mix, valid random blocks of trained-like scale."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from deepinfer.bench.user_shapes import SHAPES, random_blocks, tensor_plan


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
