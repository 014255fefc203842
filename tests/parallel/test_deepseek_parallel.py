"""A tiny DeepSeek-V3 (MLA, 1 dense + 2 MoE layers, 8 routed experts in 4 groups, a shared
expert) over two ranks against one process: tensor parallel (heads, MLP and every expert's
intermediate dimension split), and attention data parallel with the experts sharded (EP=2, the
ranks stepping together, an idle rank running empty steps) while EPLB re-places them live.
Greedy outputs are the same, batched and chunked; logits within 1e-4."""

from __future__ import annotations

import pytest

from deepinfer import LLM
from tests.parallel.helpers import DEEPSEEK_PARAMS as PARAMS

pytestmark = pytest.mark.slow

CHUNKED = {"prefill_chunk_size": 32, "max_num_batched_tokens": 64}


def _check(llm: LLM, prompts: list[list[int]], reference) -> None:
    alone, logits = reference
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert batched == alone
    for prompt, expected in zip(prompts, logits):
        assert (llm.engine.core.score(prompt) - expected).abs().max().item() < 1e-4


def test_tensor_parallel(tiny_v3, prompts, reference):
    llm = LLM(model=str(tiny_v3.path), num_blocks=128, num_threads=1, tensor_parallel_size=2, **CHUNKED)
    try:
        attn = llm.engine.core.loaded.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.q_b_proj.shape[0] == 2 * 48  # 2 of the 4 heads
        _check(llm, prompts, reference)
    finally:
        llm.close()


def test_data_parallel_with_expert_parallel_and_live_eplb(tiny_v3, prompts, reference):
    llm = LLM(
        model=str(tiny_v3.path),
        num_blocks=128,
        num_threads=1,
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        num_redundant_experts=2,
        eplb_interval=3,
        **CHUNKED,
    )
    try:
        engine = llm.engine.core
        experts = engine.core.runner.experts
        first = engine.core.loaded.model.expert_layers()[0]
        assert first.w13.shape[0] == 5  # (8 + 2 redundant) / 2 ranks
        _check(llm, prompts, reference)
        assert experts.num_rebalances >= 1  # experts moved while the requests ran
        before, after = experts.last_balancedness
        assert after > before
        # Both ranks served requests, and each reports its own stats.
        assert all(engine.balancer.num_routed)
        stats = engine.stats()
        assert len(stats.per_rank) == 2 and stats.num_blocks == 256
        # Alone on rank 1, rank 0 runs empty steps with it: still the same tokens.
        engine.balancer.report(0, 100)
        [out] = llm.generate([prompts[2]], PARAMS, use_tqdm=False)
        assert out.outputs[0].token_ids == reference[0][2]
    finally:
        llm.close()


def test_tensor_parallel_with_expert_parallel(tiny_v3, prompts, reference):
    llm = LLM(
        model=str(tiny_v3.path),
        num_blocks=128,
        num_threads=1,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        **CHUNKED,
    )
    try:
        assert llm.engine.core.loaded.model.expert_layers()[0].w13.shape[0] == 4
        _check(llm, prompts, reference)
    finally:
        llm.close()
