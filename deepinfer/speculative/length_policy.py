"""How many draft tokens to verify for each sequence this step.

Acceptance: a proposal of k drafts yields every draft up to the first rejection, plus one token
sampled by the target (the correction, or the bonus when all k pass). With alpha_j the probability
that draft j is accepted given drafts 1..j-1 were, the probability that the first r drafts all pass
is P_r = alpha_1 * ... * alpha_r, and the expected output of a step with k drafts is
1 + E[k] where E[k] = P_1 + ... + P_k.

Estimates: each sequence keeps an exponentially weighted average of its acceptance at every draft
position, fed with the exact acceptance probability of each verified draft (sum_x min(p, q), or 0/1
under greedy decoding). The first position a step did not verify drifts toward 1, so a sequence
that stopped speculating probes again (one position further each time) once its text may have
become predictable.

Choice: over the candidates of one step, maximize expected output tokens per second,
sum_i (1 + E_i[k_i]) / cost(k), with cost from the startup profile: the target forward at the
step's batch tokens (so extra tokens get dearer as the batch grows), a per-sequence cost of
verifying a chunk, and the drafting rounds. The marginal gain of a sequence's (k+1)-th draft is
P_{k+1}, non-increasing in k, so adding draft tokens in order of gain and scanning the totals finds
the best allocation. Hysteresis keeps the previous step's lengths unless the new choice is better
by a margin, so estimates hovering near a boundary do not make k thrash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from deepinfer.speculative.cost_model import StepCostModel


def all_accepted_probs(alphas: Sequence[float]) -> list[float]:
    """P_r for r = 1..len(alphas): the probability that drafts 1..r are all accepted."""
    out, running = [], 1.0
    for alpha in alphas:
        running *= min(max(alpha, 0.0), 1.0)
        out.append(running)
    return out


def expected_accepted(alphas: Sequence[float], k: int) -> float:
    """E[k]: expected accepted drafts when verifying the first k."""
    if k < 0 or k > len(alphas):
        raise ValueError(f"k must be in [0, {len(alphas)}], got {k}")
    return sum(all_accepted_probs(alphas[:k]))


class AcceptanceEstimator:
    """Per-position acceptance rates as exponentially weighted averages."""

    __slots__ = ("alphas", "rate")

    def __init__(self, prior: Sequence[float], rate: float = 0.25) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.alphas = [float(a) for a in prior]
        self.rate = rate

    def observe(self, accept_probs: Sequence[float]) -> None:
        """Acceptance probabilities of verified draft positions 1, 2, ... (those the step reached)."""
        for j, p in enumerate(accept_probs[: len(self.alphas)]):
            self.alphas[j] += self.rate * (float(p) - self.alphas[j])

    def relax(self, position: int, toward: float, rate: float) -> None:
        """Move one position's (0-based) estimate toward `toward` by `rate` (no-op past the end)."""
        if 0 <= position < len(self.alphas):
            self.alphas[position] += rate * (toward - self.alphas[position])


@dataclass(slots=True)
class Candidate:
    seq_id: int
    alphas: list[float]  # estimated acceptance of drafts 1, 2, ... (at least max_k of them)
    max_k: int  # most drafts this sequence may take this step


@dataclass(slots=True)
class LengthChoice:
    lengths: dict[int, int]  # seq_id -> drafts to verify (0: a plain decode)
    goodput: float = 0.0  # expected output tokens per second of the step (dynamic mode)
    # Verifying one more draft is worth it only when its P_r exceeds this (goodput x the marginal
    # cost of a token): the cutoff a proposer with per-token confidence applies while drafting.
    verify_threshold: float = 0.0


class LengthPolicy:
    def __init__(
        self,
        mode: Literal["fixed", "dynamic", "confidence"],
        max_k: int,
        cost: StepCostModel | None = None,
        hysteresis: float = 0.05,
    ) -> None:
        if mode not in ("fixed", "dynamic", "confidence"):
            raise ValueError(f"speculative_length: expected 'fixed', 'dynamic' or 'confidence', got {mode!r}")
        if max_k < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {max_k}")
        if mode == "dynamic" and cost is None:
            raise ValueError("the dynamic length policy needs a step cost model")
        self.mode = mode
        self.max_k = max_k
        self.cost = cost
        self.hysteresis = hysteresis
        self._previous: dict[int, int] = {}

    def choose(self, candidates: list[Candidate], other_tokens: int = 0) -> LengthChoice:
        """Lengths for this step's decode sequences; `other_tokens` are the step's prefill tokens.
        Fixed and confidence modes reserve the most (confidence mode chooses after drafting)."""
        bounds = {c.seq_id: max(0, min(c.max_k, self.max_k, len(c.alphas))) for c in candidates}
        if self.mode != "dynamic":
            return LengthChoice(bounds)
        best, goodput, threshold = self._best(candidates, bounds, other_tokens)
        previous = {
            c.seq_id: min(self._previous.get(c.seq_id, best[c.seq_id]), bounds[c.seq_id]) for c in candidates
        }
        if previous != best:
            kept = self.goodput(candidates, previous, other_tokens)
            if kept * (1.0 + self.hysteresis) >= goodput:
                best, goodput = previous, kept
        self._previous = dict(best)
        return LengthChoice(best, goodput, threshold)

    def goodput(self, candidates: list[Candidate], lengths: dict[int, int], other_tokens: int = 0) -> float:
        """Expected output tokens per second of a step with these lengths."""
        assert self.cost is not None
        tokens = 0.0
        batch_tokens = other_tokens
        rows = [0] * (self.max_k + 1)
        for c in candidates:
            k = lengths.get(c.seq_id, 0)
            tokens += 1.0 + expected_accepted(c.alphas, k)
            batch_tokens += 1 + k
            for r in range(1, k + 1):
                rows[r] += 1
        num_chunked = sum(1 for c in candidates if lengths.get(c.seq_id, 0) > 0)
        seconds = self.cost.step_seconds(batch_tokens, num_chunked, rows[1:])
        return tokens / seconds if seconds > 0 else 0.0

    def _best(
        self, candidates: list[Candidate], bounds: dict[int, int], other_tokens: int
    ) -> tuple[dict[int, int], float, float]:
        """Add drafts in order of gain P_r; keep the total with the highest goodput."""
        cost = self.cost
        assert cost is not None
        increments: list[tuple[float, int, int]] = []  # (gain, position r, candidate index)
        for index, c in enumerate(candidates):
            for r, gain in enumerate(all_accepted_probs(c.alphas[: bounds[c.seq_id]]), start=1):
                increments.append((gain, r, index))
        increments.sort(key=lambda inc: (-inc[0], inc[1]))

        tokens = float(len(candidates))
        batch_tokens = other_tokens + len(candidates)
        num_chunked = 0
        rows = [0] * (self.max_k + 1)
        draft_seconds = 0.0
        draft_round = cost.draft_round

        def seconds() -> float:
            return (
                cost.verify(max(batch_tokens, 1))
                + cost.step_overhead
                + cost.chunk_overhead * num_chunked
                + draft_seconds
            )

        best_count, best_goodput = 0, tokens / seconds() if candidates else 0.0
        best_tokens = batch_tokens
        for count, (gain, r, _) in enumerate(increments, start=1):
            tokens += gain
            batch_tokens += 1
            if r == 1:
                num_chunked += 1
            rows[r] += 1
            if draft_round is not None:
                draft_seconds += draft_round(rows[r]) - (draft_round(rows[r] - 1) if rows[r] > 1 else 0.0)
            value = tokens / seconds()
            if value > best_goodput:
                best_count, best_goodput, best_tokens = count, value, batch_tokens
        lengths = {c.seq_id: 0 for c in candidates}
        for _, r, index in increments[:best_count]:
            lengths[candidates[index].seq_id] = max(lengths[candidates[index].seq_id], r)
        marginal = cost.verify(best_tokens + 1) - cost.verify(best_tokens)
        return lengths, best_goodput, best_goodput * marginal
