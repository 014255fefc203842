"""EPLB placement policy on synthetic skewed loads."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.distributed.eplb import balancedness, identity_placement, rank_loads, rebalance


def skewed(num_layers: int, num_experts: int, seed: int, power: float = 1.2) -> np.ndarray:
    """Zipf-like token counts, the hot experts shuffled per layer."""
    rng = np.random.default_rng(seed)
    base = 10_000 / np.arange(1, num_experts + 1) ** power
    return np.stack([np.round(base[rng.permutation(num_experts)]) for _ in range(num_layers)])


@pytest.mark.parametrize(("num_experts", "num_ranks", "redundant"), [(16, 4, 4), (64, 8, 16), (8, 2, 2)])
def test_global_policy_reaches_09_with_redundancy(num_experts, num_ranks, redundant):
    load = skewed(4, num_experts, seed=num_experts)
    physical = num_experts + redundant
    before = balancedness(load, identity_placement(4, num_experts, physical), num_ranks)
    placement = rebalance(load, physical, num_ranks, policy="global")
    after = balancedness(load, placement, num_ranks)
    assert before < 0.9
    assert after >= 0.9 and after > before
    # Every logical expert keeps a replica; every rank gets its share of slots.
    counts = placement.replica_counts(num_experts)
    assert (counts >= 1).all() and (counts.sum(axis=1) == physical).all()
    assert rank_loads(load, placement, num_ranks).shape == (4, num_ranks)


def test_hierarchical_policy_keeps_groups_on_a_node_and_balances():
    num_experts, groups, nodes, ranks, physical = 32, 8, 2, 4, 48
    load = skewed(3, num_experts, seed=1, power=0.8)
    placement = rebalance(load, physical, ranks, num_groups=groups, num_nodes=nodes, policy="auto")
    per_node = physical // nodes
    group_size = num_experts // groups
    for row in placement.physical_to_logical:
        for node in range(nodes):
            node_groups = {int(e) // group_size for e in row[node * per_node : (node + 1) * per_node]}
            assert len(node_groups) == groups // nodes  # whole groups, each on one node
    before = balancedness(load, identity_placement(3, num_experts, physical), ranks)
    assert balancedness(load, placement, ranks) >= 0.9 > before


def test_replicas_of_an_expert_go_to_different_ranks():
    load = np.zeros((1, 8))
    load[0, 3] = 1000.0  # one very hot expert gets every redundant slot
    placement = rebalance(load + 1, 12, 4, policy="global")
    row = placement.physical_to_logical[0]
    holders = [p // 3 for p in np.flatnonzero(row == 3)]
    assert len(holders) == 5 and len(set(holders)) == 4  # 5 replicas over 4 ranks: all of them


def test_policy_is_deterministic_and_checks_its_inputs():
    load = skewed(2, 16, seed=5)
    first = rebalance(load, 20, 4).physical_to_logical
    assert (rebalance(load, 20, 4).physical_to_logical == first).all()
    with pytest.raises(ValueError, match="divide"):
        rebalance(load, 18, 4)
    with pytest.raises(ValueError, match="hierarchical"):
        rebalance(load, 20, 4, num_groups=3, num_nodes=2, policy="hierarchical")
