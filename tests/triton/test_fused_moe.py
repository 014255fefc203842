"""Routed experts as grouped GEMMs over pairs sorted by expert, against RoutedExperts (the model's
per-expert matmuls), with and without DeepSeek-V4's SwiGLU clamp."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.fused_moe import BLOCK_M, expert_pairs, sort_pairs
from deepinfer.model.layers.expert_parallel import combine_pairs
from deepinfer.model.layers.moe import RoutedExperts


def test_sorted_layout_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # expert 0: pairs 1, 4; 1: pair 3; 2: pairs 0, 2, 5
    order, rows, tile_expert = sort_pairs(ids, 4)
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
    assert tile_expert.tolist() == [0, 1, 2]  # expert 3 has no pair and no tile
    expected = [[0, 2], [1], [0, 1, 2]]  # token of each pair, per expert's tile
    for tile, tokens in enumerate(expected):
        block = rows[tile * BLOCK_M : (tile + 1) * BLOCK_M].tolist()
        assert block == tokens + [-1] * (BLOCK_M - len(tokens))


@pytest.mark.parametrize("limit", [None, 0.5])
def test_matches_routed_experts(limit, device):
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 21, 48, 40, 6, 2
    layer = RoutedExperts(experts, hidden, inter, swiglu_limit=limit)
    layer.w13.data.normal_(0, 0.2)
    layer.w2.data.normal_(0, 0.2)
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    ids[ids == 5] = 4  # expert 5 gets no token
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % 5, ids[:, 1])
    weights = torch.rand(tokens, top_k)
    expected = layer(x, weights, ids)
    on = [t.to(device) for t in (x, ids, layer.w13.data, layer.w2.data)]
    order, outputs = expert_pairs(*on, limit)
    out = combine_pairs(on[0], outputs, weights.to(device), order, top_k).cpu()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
