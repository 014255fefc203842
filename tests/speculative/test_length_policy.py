"""The verification-length policy: expected-acceptance math, the goodput choice, its stability."""

from __future__ import annotations

import pytest

from deepinfer.speculative.cost_model import CostCurve, StepCostModel
from deepinfer.speculative.length_policy import (
    AcceptanceEstimator,
    Candidate,
    LengthPolicy,
    all_accepted_probs,
    expected_accepted,
)

# A GPU-like target: flat up to 16 tokens, then linear (memory bound, then compute bound).
FLAT_THEN_LINEAR = StepCostModel(CostCurve([1, 16, 64, 256], [0.010, 0.010, 0.040, 0.160]))


def test_expected_accepted_length_math():
    assert all_accepted_probs([0.5, 0.5, 0.5]) == [0.5, 0.25, 0.125]
    assert expected_accepted([0.5, 0.5, 0.5], 0) == 0.0
    assert expected_accepted([0.5, 0.5, 0.5], 3) == pytest.approx(0.875)
    # A constant rate a gives the geometric sum a (1 - a^k) / (1 - a).
    a, k = 0.8, 5
    assert expected_accepted([a] * k, k) == pytest.approx(a * (1 - a**k) / (1 - a))
    assert expected_accepted([1.0] * 4, 4) == 4.0
    with pytest.raises(ValueError):
        expected_accepted([0.5], 2)


def test_estimator_tracks_acceptance_and_relaxes_one_position():
    estimator = AcceptanceEstimator([0.5, 0.5, 0.5], rate=0.5)
    estimator.observe([1.0, 0.0])
    assert estimator.alphas == [0.75, 0.25, 0.5]
    estimator.relax(2, 1.0, 0.5)
    estimator.relax(3, 1.0, 0.5)  # past the end: nothing
    assert estimator.alphas == [0.75, 0.25, 0.75]


def choose(policy: LengthPolicy, alpha: float, num_seqs: int = 1, max_k: int = 8) -> list[int]:
    candidates = [Candidate(i, [alpha] * max_k, max_k) for i in range(num_seqs)]
    return [policy.choose(candidates).lengths[i] for i in range(num_seqs)]


def test_fixed_policy_takes_the_bound():
    policy = LengthPolicy("fixed", 5)
    choice = policy.choose(
        [Candidate(0, [0.1] * 5, 5), Candidate(1, [0.9] * 5, 3), Candidate(2, [0.9] * 5, 0)]
    )
    assert choice.lengths == {0: 5, 1: 3, 2: 0}


def test_dynamic_k_grows_with_acceptance():
    cost = StepCostModel(CostCurve([1, 2, 4, 8], [0.010, 0.0115, 0.013, 0.016]))
    ks = [
        choose(LengthPolicy("dynamic", 8, cost, hysteresis=0.0), a)[0] for a in (0.0, 0.2, 0.5, 0.7, 0.9, 1.0)
    ]
    assert ks == sorted(ks)
    assert ks[0] == 0 and ks[-1] == 8


def test_dynamic_k_shrinks_as_tokens_get_dearer():
    slopes = [0.0, 0.001, 0.003, 0.01]
    ks = []
    for slope in slopes:
        cost = StepCostModel(CostCurve([1, 9], [0.010, 0.010 + 8 * slope]))
        ks.append(choose(LengthPolicy("dynamic", 8, cost, hysteresis=0.0), 0.7)[0])
    assert ks == sorted(ks, reverse=True)
    assert ks[0] == 8 and ks[-1] < 8


def test_dynamic_policy_is_batch_aware():
    """Verification is free for one sequence, but 64 sequences already fill the flat region."""
    one = choose(LengthPolicy("dynamic", 8, FLAT_THEN_LINEAR, hysteresis=0.0), 0.6, num_seqs=1)
    many = choose(LengthPolicy("dynamic", 8, FLAT_THEN_LINEAR, hysteresis=0.0), 0.6, num_seqs=64)
    assert one == [8]
    assert max(many) <= 2


def test_dynamic_policy_favours_sequences_that_accept_more():
    policy = LengthPolicy("dynamic", 8, FLAT_THEN_LINEAR, hysteresis=0.0)
    candidates = [Candidate(i, [0.95 if i % 2 else 0.3] * 8, 8) for i in range(8)]
    lengths = policy.choose(candidates).lengths
    assert min(lengths[i] for i in range(1, 8, 2)) > max(lengths[i] for i in range(0, 8, 2))


def test_dynamic_choice_respects_bounds():
    policy = LengthPolicy("dynamic", 4, FLAT_THEN_LINEAR, hysteresis=0.0)
    choice = policy.choose(
        [Candidate(0, [1.0] * 8, 2), Candidate(1, [1.0] * 8, 0), Candidate(2, [1.0] * 8, 9)]
    )
    assert choice.lengths == {0: 2, 1: 0, 2: 4}
    assert all(k >= 0 for k in choose(policy, 0.0, num_seqs=3))


def test_hysteresis_keeps_the_previous_choice_near_a_tie():
    """Estimates wobbling around the point where k=0 and k=1 tie must not flip k every step."""
    cost = StepCostModel(CostCurve([1, 2], [0.010, 0.015]))  # a draft pays when alpha > 0.5
    policy = LengthPolicy("dynamic", 1, cost, hysteresis=0.05)
    wobble = [0.52, 0.49, 0.53, 0.48, 0.51, 0.50]
    ks = [choose(policy, a, max_k=1)[0] for a in wobble]
    assert len(set(ks)) == 1
    # Without hysteresis the same estimates thrash.
    policy = LengthPolicy("dynamic", 1, cost, hysteresis=0.0)
    assert len({choose(policy, a, max_k=1)[0] for a in wobble}) == 2
    # A clear change still switches.
    sticky = LengthPolicy("dynamic", 1, cost, hysteresis=0.05)
    assert choose(sticky, 0.2, max_k=1) == [0]
    assert choose(sticky, 0.9, max_k=1) == [1]


def test_drafting_cost_lowers_the_choice():
    free = StepCostModel(CostCurve([1, 8], [0.010, 0.011]))
    costly = StepCostModel(CostCurve([1, 8], [0.010, 0.011]), draft_round=CostCurve([1, 8], [0.004, 0.005]))
    k_free = choose(LengthPolicy("dynamic", 8, free, hysteresis=0.0), 0.6)[0]
    k_costly = choose(LengthPolicy("dynamic", 8, costly, hysteresis=0.0), 0.6)[0]
    assert k_costly < k_free


def test_verify_threshold_is_goodput_times_marginal_cost():
    policy = LengthPolicy("dynamic", 4, FLAT_THEN_LINEAR, hysteresis=0.0)
    flat = policy.choose([Candidate(0, [0.8] * 4, 4)])
    assert flat.verify_threshold == 0.0  # extra tokens are free: never stop a draft early
    busy = policy.choose([Candidate(i, [0.8] * 4, 4) for i in range(100)])
    assert busy.verify_threshold > 0.0


def test_cost_curve_interpolates_and_never_decreases():
    curve = CostCurve([1, 4, 8], [1.0, 4.0, 3.0])  # the dip at 8 is noise
    assert curve.seconds == [1.0, 4.0, 4.0]
    assert curve(2) == pytest.approx(2.0)
    assert curve(0) == 1.0
    assert curve(12) == pytest.approx(4.0)
    steep = CostCurve([1, 2], [1.0, 2.0])
    assert steep(4) == pytest.approx(4.0)  # linear beyond the last point
    with pytest.raises(ValueError):
        CostCurve([], [])


def test_policy_rejects_bad_options():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LengthPolicy("fixed", 0)
    with pytest.raises(ValueError, match="speculative_length"):
        LengthPolicy("adaptive", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cost model"):
        LengthPolicy("dynamic", 4)


def test_measured_step_times_calibrate_the_choice():
    """A profile that misses what verification really costs is corrected by measured steps."""
    cost = StepCostModel(CostCurve([1, 8, 64], [0.010, 0.011, 0.030]))
    policy = LengthPolicy("dynamic", 4, cost, hysteresis=0.0)
    candidates = [Candidate(i, [0.5] * 4, 4) for i in range(8)]
    assert sum(policy.choose(candidates).lengths.values()) > 0  # by the profile alone, drafts pay
    for _ in range(200):
        cost.observe(0.012, 8, 0, [0, 0, 0, 0])  # plain decode steps: 1 ms beyond the forward
        cost.observe(0.060, 24, 8, [8, 8, 0, 0])  # verifying steps: far dearer than profiled
    assert cost.step_overhead == pytest.approx(0.001, rel=0.05)
    assert cost.chunk_overhead == pytest.approx((0.060 - cost.verify(24) - 0.001) / 8, rel=0.05)
    assert sum(policy.choose(candidates).lengths.values()) == 0
