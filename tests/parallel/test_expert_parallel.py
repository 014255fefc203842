"""Expert-parallel dispatch and combine on two real ranks over gloo, against the single-process
MoE layer on the same tokens: random routing, experts that get no tokens, a rank with no tokens."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import ep_cases
from tests.parallel.ranks import run_ranks

pytestmark = pytest.mark.slow


def _split(outputs: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """The reference outputs of every step, cut into each rank's rows."""
    per_rank = [[] for _ in range(world)]
    for step, out in enumerate(outputs):
        start = 0
        for rank in range(world):
            count = ep_cases.tokens_of(rank, step)
            per_rank[rank].append(out[start : start + count])
            start += count
    return per_rank


def test_dispatch_and_combine_are_exact():
    world = 2
    expected = _split(ep_cases.reference(world), world)
    results = run_ranks(ep_cases.dispatch_combine, world, 0)
    for rank in range(world):
        for step, (ours, theirs) in enumerate(zip(results[rank], expected[rank])):
            assert ours.shape == theirs.shape
            assert torch.equal(ours, theirs), f"rank {rank} step {step}"


def test_redundant_replicas_and_a_live_move_keep_the_outputs():
    world = 2
    expected = _split(ep_cases.reference(world), world)
    with_replicas = run_ranks(ep_cases.dispatch_combine, world, 2)
    results = run_ranks(ep_cases.moved, world)
    for rank in range(world):
        for ours, theirs in zip(with_replicas[rank], expected[rank]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        outs, placement, rebalances = results[rank]
        assert rebalances == 1
        assert placement == results[0][1]  # every rank adopted the same placement
        assert sorted(set(placement)) == list(range(8)) and len(placement) == 10
        assert placement.count(6) == placement.count(7) == 1  # the redundant slots went to busy experts
        for ours, theirs in zip(outs, expected[rank]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
