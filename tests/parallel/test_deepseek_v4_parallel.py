"""A tiny DeepSeek-V4 (sliding, CSA and HCA layers, hash-routed and learned-routed MoE, mHC) over
two ranks against one process: tensor parallel (query heads split by output group, each expert's
intermediate dimension split, the vocabulary in halves), tensor parallel with the experts sharded
(EP=2), and attention data parallel with the experts sharded (DP=2, EP=2, the ranks stepping
together). Greedy outputs are the same, batched and chunked; logits within 1e-4."""

from __future__ import annotations

import os

import pytest

from deepinfer import LLM
from deepinfer.config import ConfigError
from tests.parallel.helpers import DEEPSEEK_PARAMS as PARAMS
from tests.parallel.helpers import V4_ENGINE, rank_processes

pytestmark = pytest.mark.slow

# 16-token prefill chunks, 32 tokens a step: the longer prompts are chunked, and chunks share
# steps with decode rows.
CHUNKED = {"prefill_chunk_size": 16, "max_num_batched_tokens": 32}


def _check(llm: LLM, prompts: list[list[int]], reference) -> None:
    alone, logits, _ = reference
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert batched == alone
    for prompt, expected in zip(prompts, logits):
        ours = llm.engine.core.score(prompt)
        assert ours.shape == expected.shape
        assert (ours - expected).abs().max().item() < 1e-4


def test_tensor_parallel(tiny_v4, v4_prompts, v4_reference):
    llm = LLM(model=str(tiny_v4.path), tensor_parallel_size=2, **V4_ENGINE, **CHUNKED)
    try:
        model = llm.engine.core.loaded.model
        attn = model.layers[1].attn  # a CSA layer: its compressor and indexer stay whole
        assert (attn.num_heads, attn.num_groups) == (2, 1)  # 1 of the 2 output groups of 2 heads
        assert attn.wq_b.shape[0] == 2 * 32 and attn.wo_b.shape[1] == 16
        assert attn.wkv.shape[0] == 32 and attn.indexer.wq_b.shape[0] == 16 * 16
        assert model.layers[2].ffn.experts.w13.shape == (8, 32, 64)  # 8 experts, half of 2 x 32 rows
        assert model.embed.weight.shape[0] == -(-tiny_v4.config["vocab_size"] // 2)
        _check(llm, v4_prompts, v4_reference)
    finally:
        llm.close()


def test_tensor_parallel_with_expert_parallel(tiny_v4, v4_prompts, v4_reference):
    llm = LLM(
        model=str(tiny_v4.path), tensor_parallel_size=2, enable_expert_parallel=True, **V4_ENGINE, **CHUNKED
    )
    try:
        assert llm.engine.core.loaded.model.expert_layers()[0].w13.shape == (4, 64, 64)  # whole experts
        _check(llm, v4_prompts, v4_reference)
    finally:
        llm.close()


def test_data_parallel_with_expert_parallel(tiny_v4, v4_prompts, v4_reference):
    llm = LLM(
        model=str(tiny_v4.path), data_parallel_size=2, enable_expert_parallel=True, **V4_ENGINE, **CHUNKED
    )
    try:
        engine = llm.engine.core
        assert len(engine.core.loaded.model.expert_layers()) == 5  # hash layers too
        _check(llm, v4_prompts, v4_reference)
        assert all(engine.balancer.num_routed)  # both ranks served requests
        # Alone on rank 1, rank 0 runs empty steps with it: still the same tokens.
        engine.balancer.report(0, 100)
        [out] = llm.generate([v4_prompts[2]], PARAMS, use_tqdm=False)
        assert out.outputs[0].token_ids == v4_reference[0][2]
    finally:
        llm.close()


def test_more_ranks_than_output_groups_are_refused_before_any_rank_starts(tiny_v4):
    with pytest.raises(ConfigError, match="o_groups=2") as error:
        LLM(model=str(tiny_v4.path), tensor_parallel_size=4, **V4_ENGINE)
    assert error.value.name == "tensor_parallel_size"
    assert not rank_processes(os.getpid())
