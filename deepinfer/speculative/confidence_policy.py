"""Confidence-scheduled verification: how many of its drafts each sequence verifies, chosen after
drafting from the drafts' own confidences and the step cost profiled at startup.

A proposer with confidences gives c_1, c_2, ... in [0, 1] per sequence (its estimate that draft j
is accepted once drafts 1..j-1 were), so P_j = c_1 * ... * c_j is the probability that drafts 1..j
all pass, and a sequence verifying k drafts yields 1 + P_1 + ... + P_k tokens in expectation (the
accepted drafts and the correction or bonus token). A step that verifies T tokens in all (every
scheduled token, drafts included) takes seconds(T) = verify(T) + the per-step overhead + the
drafting it already did; the policy picks the lengths that maximize expected tokens / seconds(T).

Adding drafts in order of gain is optimal. For a fixed number m of verified drafts the step's
time is fixed, so the best m drafts are those with the largest sum of gains. Confidences are at
most 1, so P_j <= P_(j-1) along each sequence, and the m largest gains over all sequences (ties
to the earlier position) are a prefix of each sequence's drafts: a valid choice of lengths, and
no other choice of m drafts sums to more. Scanning m = 0, 1, ... over the gains in decreasing
order and keeping the best ratio (the fewest tokens among equal ratios) is therefore the optimum.

Drafting floor: a draft whose P_j lies below f(0) * s, with f(0) the step's goodput verifying no
draft and s the least slope of the cost curve over the totals the step can reach, is never part
of the optimum, whatever the other sequences drafted. (If the optimum verified ranks r..m beyond
the best r-1, its goodput would lie between that of r-1 drafts and the ratio of those ranks' gains
to their cost, so that ratio would reach at least the optimum >= f(0); but each of those gains is
below f(0) * s and each token costs at least s.) So drafting may stop there: every later draft
of the sequence has a smaller P and would not be verified either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.speculative.cost_model import CostCurve, StepCostModel
from deepinfer.speculative.length_policy import all_accepted_probs


@dataclass(slots=True)
class Allocation:
    lengths: list[int]  # drafts to verify, per candidate (in the order given)
    expected_tokens: float  # expected output tokens of the step
    total_tokens: int  # tokens in the verifying forward
    seconds: float  # the cost model's time for the step

    @property
    def goodput(self) -> float:
        return self.expected_tokens / self.seconds if self.seconds > 0 else 0.0


def least_slope(curve: CostCurve, start: float) -> float:
    """The least slope (seconds per token) of the piecewise-linear curve at counts >= start: a
    lower bound on (curve(b) - curve(a)) / (b - a) for all start <= a < b."""
    xs, ys = curve.counts, curve.seconds
    if len(xs) == 1:
        return ys[0] / max(xs[0], 1)
    slopes = [0.0] if start < xs[0] else []  # the curve is flat up to its first point
    for i in range(1, len(xs)):
        if xs[i] > start:
            slopes.append((ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]))
    if not slopes:  # past the last point the last segment's slope continues
        slopes.append((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return max(min(slopes), 0.0)


class ConfidencePolicy:
    """Lengths from confidences on a step cost model; `cost` is the startup profile (or a
    synthetic one in tests), its per-step overhead learned from measured steps."""

    def __init__(self, cost: StepCostModel) -> None:
        self.cost = cost

    def seconds(self, total_tokens: int, draft_seconds: float) -> float:
        """The step's time with `total_tokens` in the forward, after `draft_seconds` of drafting."""
        return self.cost.verify(max(total_tokens, 1)) + self.cost.step_overhead + draft_seconds

    def draft_seconds(self, rows_per_round: Sequence[int]) -> float:
        """Drafting rounds of the given row counts, on the profiled drafting curve."""
        curve = self.cost.draft_round
        return 0.0 if curve is None else sum(curve(rows) for rows in rows_per_round if rows)

    def drafting_floor(self, base_tokens: int, base_expected: float, draft_seconds_bound: float) -> float:
        """A P below which no draft is verified (see the module docstring): `base_tokens` are the
        step's tokens without drafts, `base_expected` its output tokens, `draft_seconds_bound`
        at least the drafting it will do."""
        if base_expected <= 0:
            return 0.0
        goodput = base_expected / self.seconds(base_tokens, draft_seconds_bound)
        return goodput * least_slope(self.cost.verify, base_tokens)

    def allocate(
        self,
        confidences: Sequence[Sequence[float]],
        base_tokens: int,
        base_expected: float,
        draft_seconds: float,
    ) -> Allocation:
        """The optimal lengths for candidates with these per-draft confidences, in a step that
        also carries `base_tokens` (every non-draft token, and drafts already decided) yielding
        `base_expected` output tokens; `draft_seconds` is the drafting already done."""
        gains = [
            (gain, position, index)
            for index, row in enumerate(confidences)
            for position, gain in enumerate(all_accepted_probs(row), start=1)
        ]
        gains.sort(key=lambda g: (-g[0], g[1], g[2]))
        expected, total = base_expected, base_tokens
        best_count, best_expected, best_total = 0, expected, total
        best_seconds = self.seconds(total, draft_seconds)
        for count, (gain, _, _) in enumerate(gains, start=1):
            expected += gain
            total += 1
            seconds = self.seconds(total, draft_seconds)
            # expected / seconds > best_expected / best_seconds, without dividing by zero
            if expected * best_seconds > best_expected * seconds:
                best_count, best_expected, best_total, best_seconds = count, expected, total, seconds
        lengths = [0] * len(confidences)
        for _, _, index in gains[:best_count]:
            lengths[index] += 1
        return Allocation(lengths, best_expected, best_total, best_seconds)
