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


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(ep_cases.every_case, 2)


@pytest.fixture(scope="module")
def expected() -> list[list[torch.Tensor]]:
    return _split(ep_cases.reference(2), 2)


def test_dispatch_and_combine_are_exact(ranks, expected):
    for rank, result in enumerate(ranks):
        for step, (ours, theirs) in enumerate(zip(result["exact"], expected[rank])):
            assert ours.shape == theirs.shape
            assert torch.equal(ours, theirs), f"rank {rank} step {step}"


def test_redundant_replicas_and_a_live_move_keep_the_outputs(ranks, expected):
    for rank, result in enumerate(ranks):
        for ours, theirs in zip(result["replicas"], expected[rank]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        outs, placement, rebalances = result["moved"]
        assert rebalances == 1
        assert placement == ranks[0]["moved"][1]  # every rank adopted the same placement
        assert sorted(set(placement)) == list(range(8)) and len(placement) == 10
        assert placement.count(6) == placement.count(7) == 1  # the redundant slots went to busy experts
        for ours, theirs in zip(outs, expected[rank]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
