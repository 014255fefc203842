"""The confidence policy on synthetic cost curves and confidences whose optimum is known.

Expected tokens of a sequence verifying k drafts: 1 + P_1 + ... + P_k with P_j the product of its
first j confidences; the policy maximizes the step's expected tokens / seconds(total tokens).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.config.engine import CONFIDENCE_METHODS, SPECULATIVE_METHODS
from deepinfer.speculative.confidence_policy import ConfidencePolicy, least_slope
from deepinfer.speculative.cost_model import CostCurve, StepCostModel
from deepinfer.speculative.draft_model import DraftModelProposer
from deepinfer.speculative.dspark import DSparkProposer
from deepinfer.speculative.mtp import MTPProposer
from deepinfer.speculative.ngram import NgramProposer
from deepinfer.speculative.proposer import sampled_confidence

# 10 ms up to 4 tokens (the hardware is underused), then 2.5 ms per token up to 8.
FLAT_THEN_STEEP = StepCostModel(CostCurve([1, 4, 8], [0.010, 0.010, 0.020]))


def test_the_hand_computed_optimum():
    # A: P = 0.9, 0.72, 0.36; B: P = 0.6, 0.3, 0.27. Two tokens without drafts; adding drafts in
    # order of gain, expected tokens / seconds at m = 0..6 verified drafts:
    # 2/.010 = 200, 2.9/.010 = 290, 3.62/.010 = 362, 4.22/.0125 = 337.6, 4.58/.015 = 305.3,
    # 4.88/.0175 = 278.9, 5.15/.020 = 257.5. Best: m = 2, both A's first drafts, none of B's.
    policy = ConfidencePolicy(FLAT_THEN_STEEP)
    choice = policy.allocate([[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]], 2, 2.0, 0.0)
    assert choice.lengths == [2, 0]
    assert choice.total_tokens == 4
    assert choice.expected_tokens == pytest.approx(3.62)
    assert choice.goodput == pytest.approx(362.0)
    # B's first draft (gain 0.6) would cost 2.5 ms, and 362 tokens/s x 2.5 ms = 0.905 > 0.6: the
    # curve does not pay for it. With B's first confidence at 0.95, the two cheap slots go to the
    # two largest gains, B1 (0.95) and A1 (0.9): 3.85 / .010 = 385; A2 after them would give
    # 4.57 / .0125 = 365.6.
    assert policy.allocate([[0.9, 0.8, 0.5], [0.95, 0.5, 0.9]], 2, 2.0, 0.0).lengths == [1, 1]


def test_a_flat_curve_verifies_everything_and_a_steep_one_nothing():
    flat = ConfidencePolicy(StepCostModel(CostCurve([1, 64], [0.01, 0.01])))
    assert flat.allocate([[0.5, 0.5], [0.1]], 2, 2.0, 0.0).lengths == [2, 1]
    # Each token costs as much as the whole step: even a certain draft does not pay.
    steep = ConfidencePolicy(StepCostModel(CostCurve([1, 2], [0.01, 0.02])))
    assert steep.allocate([[1.0, 1.0], [0.9]], 2, 2.0, 0.0).lengths == [0, 0]


def test_drafting_already_done_makes_verification_cheaper_relative_to_the_step():
    # After a sunk 20 ms of drafting, m = 2..6 give 3.62/.030 = 120.7, 4.22/.0325 = 129.85,
    # 4.58/.035 = 130.86, 4.88/.0375 = 130.13, 5.15/.040 = 128.75: best m = 4 (A's three, B's first).
    policy = ConfidencePolicy(FLAT_THEN_STEEP)
    assert policy.allocate([[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]], 2, 2.0, 0.020).lengths == [3, 1]


def brute_force(policy, confidences, base_tokens, base_expected, draft_seconds):
    best, best_value = None, -1.0
    for lengths in itertools.product(*[range(len(row) + 1) for row in confidences]):
        expected = base_expected
        for row, k in zip(confidences, lengths):
            running = 1.0
            for c in row[:k]:
                running *= c
                expected += running
        value = expected / policy.seconds(base_tokens + sum(lengths), draft_seconds)
        if value > best_value + 1e-12:
            best, best_value = list(lengths), value
    return best, best_value


def random_curve(rng: random.Random) -> StepCostModel:
    counts = sorted(rng.sample(range(1, 40), 4))
    seconds = sorted(rng.uniform(0.005, 0.05) for _ in counts)
    draft = CostCurve([1, 8], sorted(rng.uniform(0.0, 0.01) for _ in range(2)))
    return StepCostModel(CostCurve(counts, seconds), step_overhead=rng.uniform(0, 0.005), draft_round=draft)


def test_greedy_allocation_equals_exhaustive_search():
    rng = random.Random(5)
    for _ in range(200):
        policy = ConfidencePolicy(random_curve(rng))
        confidences = [[rng.random() for _ in range(rng.randint(0, 4))] for _ in range(3)]
        base = rng.randint(3, 12)
        draft_seconds = policy.draft_seconds([3, 2, 1])
        choice = policy.allocate(confidences, base, 3.0, draft_seconds)
        _, best_value = brute_force(policy, confidences, base, 3.0, draft_seconds)
        assert choice.goodput == pytest.approx(best_value, rel=1e-9)
        assert choice.total_tokens == base + sum(choice.lengths)


def test_least_slope():
    curve = CostCurve([1, 4, 8], [0.010, 0.010, 0.020])
    assert least_slope(curve, 2) == 0.0  # the flat part
    assert least_slope(curve, 4) == pytest.approx(0.0025)
    assert least_slope(curve, 100) == pytest.approx(0.0025)  # the last slope continues
    assert least_slope(CostCurve([4], [0.02]), 1) == pytest.approx(0.005)  # proportional


def test_drafting_floor_is_hand_computed_and_never_cuts_the_optimum():
    # 2 ms per token from 1 to 8 tokens; 4 tokens without drafts take 16 ms: 250 tokens/s, and a
    # draft below 250 x 2 ms = 0.5 never pays for its token.
    policy = ConfidencePolicy(StepCostModel(CostCurve([1, 8], [0.010, 0.024])))
    assert policy.drafting_floor(4, 4.0, 0.0) == pytest.approx(0.5)
    # Whatever the other sequences drafted, a P below the floor is never in the optimum: drafting
    # that stops there (and so drafts less) leads to the same choice as drafting everything.
    rng = random.Random(7)
    cut = 0
    for _ in range(300):
        policy = ConfidencePolicy(random_curve(rng))
        base = rng.randint(3, 12)
        floor = policy.drafting_floor(base, 3.0, policy.draft_seconds([4, 4, 4]))
        full = [[rng.random() ** 0.5 for _ in range(4)] for _ in range(3)]
        stopped = [
            row[: sum(1 for p in itertools.accumulate(row, lambda a, b: a * b) if p >= floor)] for row in full
        ]
        cut += stopped != full
        drafted = [len(row) for row in stopped]
        rounds = [sum(1 for n in drafted if n >= j) for j in range(1, 5)]
        choice = policy.allocate(full, base, 3.0, policy.draft_seconds(rounds))
        assert policy.allocate(stopped, base, 3.0, policy.draft_seconds(rounds)).lengths == choice.lengths
    assert cut > 20  # the floor did stop drafting in many of the cases


def test_sampled_confidence_is_the_expected_probability_of_the_draw():
    q = torch.tensor([0.5, 0.3, 0.2])
    assert sampled_confidence(q) == pytest.approx(0.25 + 0.09 + 0.04)


def test_the_confidence_policy_needs_a_proposer_with_confidences():
    with pytest.raises(
        ValueError, match=r"speculative_length: 'confidence' needs .* speculative_method='ngram'"
    ):
        SpeculativeConfig(speculative_method="ngram", speculative_length="confidence")
    for method in CONFIDENCE_METHODS:
        SpeculativeConfig(speculative_method=method, speculative_length="confidence")
    proposers = {
        "ngram": NgramProposer,
        "draft": DraftModelProposer,
        "mtp": MTPProposer,
        "dspark": DSparkProposer,
    }
    assert set(proposers) == set(SPECULATIVE_METHODS)
    assert {m for m, cls in proposers.items() if cls.has_confidence} == set(CONFIDENCE_METHODS)
