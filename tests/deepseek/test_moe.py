"""DeepSeekMoE pieces against HF transformers' modules, and the expert-range split that expert
parallelism relies on."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.layers.moe import DeepseekMoE, RoutedExperts, RouterConfig


def _hf_v3_config(**overrides):
    from transformers import DeepseekV3Config

    base = dict(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    return DeepseekV3Config(**{**base, **overrides})


def _sorted_routing(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_router_matches_hf(norm_topk_prob):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    generator = torch.Generator().manual_seed(0)
    hf = DeepseekV3TopkRouter(_hf_v3_config(norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=generator))
        hf.e_score_correction_bias.copy_(torch.rand(16, generator=generator))
    ours = DeepseekMoE(32, 16, 2, RouterConfig(16, 4, 4, 2, "sigmoid", "noaux_tc", norm_topk_prob, 2.5)).gate
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(200, 32, generator=generator)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    hf_weights, hf_ids = _sorted_routing(hf_weights, hf_ids)
    weights, ids = _sorted_routing(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
    # Group limit: every token's experts come from at most topk_group=2 of the 4 groups.
    assert max(len(set((row // 4).tolist())) for row in ids) <= 2


def test_v2_group_limited_greedy_matches_hf():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    generator = torch.Generator().manual_seed(1)
    config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    )  # fmt: skip
    hf = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=generator))
    ours = DeepseekMoE(
        32, 16, 0, RouterConfig(16, 3, 4, 2, "softmax", "group_limited_greedy", False, 1.5)
    ).gate
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
    x = torch.randn(200, 32, generator=generator)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = _sorted_routing(*ours(x))
    hf_weights, hf_ids = _sorted_routing(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)


def test_moe_block_matches_hf():
    """Router + grouped experts + shared experts against HF's DeepseekV3MoE (per-expert loop)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    generator = torch.Generator().manual_seed(2)
    hf = DeepseekV3MoE(_hf_v3_config())
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.rand(16, generator=generator))
    ours = DeepseekMoE(32, 16, 2, RouterConfig(16, 4, 4, 2, "sigmoid", "noaux_tc", True, 2.5))
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        shared = hf.shared_experts
        ours.shared_experts.gate_up_proj.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_experts.down_proj.copy_(shared.down_proj.weight)
        x = torch.randn(1, 50, 32, generator=generator)
        torch.testing.assert_close(ours(x[0]), hf(x)[0], atol=1e-5, rtol=1e-5)


def test_expert_ranges_sum_to_the_whole():
    """Expert parallelism: each rank runs its own contiguous range; partial outputs sum to the full."""
    generator = torch.Generator().manual_seed(3)
    full = RoutedExperts(8, 16, 12)
    with torch.no_grad():
        full.w13.copy_(torch.randn(full.w13.shape, generator=generator))
        full.w2.copy_(torch.randn(full.w2.shape, generator=generator))
    x = torch.randn(40, 16, generator=generator)
    ids = torch.stack([torch.randperm(8, generator=generator)[:3] for _ in range(40)])
    weights = torch.rand(40, 3, generator=generator)
    parts = []
    for first in (0, 4):
        rank = RoutedExperts(4, 16, 12)
        with torch.no_grad():
            rank.w13.copy_(full.w13[first : first + 4])
            rank.w2.copy_(full.w2[first : first + 4])
        parts.append(rank(x, weights, ids, first_expert=first))
    expected = torch.zeros_like(x)
    for t in range(40):  # the definition, token by token
        for k in range(3):
            e = int(ids[t, k])
            gate, up = (full.w13[e] @ x[t]).split(12)
            expected[t] += weights[t, k] * (full.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(full(x, weights, ids), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-4, rtol=1e-5)


def test_router_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_group=3"):
        RouterConfig(16, 4, num_groups=3)
    with pytest.raises(ValueError, match="topk_group=5"):
        RouterConfig(16, 4, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="scoring_func"):
        RouterConfig(16, 4, scoring="relu")
