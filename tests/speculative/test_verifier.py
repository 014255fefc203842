"""The verifier is lossless: its outputs follow the target distribution whatever the drafts.

Hand-built target (p) and draft (q) distributions over a 4-token vocabulary, one pair per output
position. Each trial decodes 3 tokens by repeated verification steps with 1-3 drafts, exactly as
the engine does (draft from q, verify, continue after the accepted prefix), and the empirical
joint distribution of the 3 tokens is tested against the product of the targets with a chi-square
test (fixed seeds). Two broken verifiers (always accept; redraw from p instead of the residual on
rejection) run through the same test and must fail it. The same test runs with the lengths the
confidence policy drafts, and with a broken confidence (the drawn token's own q), which fails.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from deepinfer.runner.sampler import SamplingRow, process_logits, sample_from
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.speculative.confidence_policy import ConfidencePolicy
from deepinfer.speculative.cost_model import CostCurve, StepCostModel
from deepinfer.speculative.proposer import DraftRequest, sampled_confidence
from deepinfer.speculative.verifier import (
    Verification,
    position_rows,
    verify_greedy,
    verify_processed,
    verify_sampled,
)

VOCAB = 4
LENGTH = 3
TRIALS = 6000
# Per output position: the target p and a deliberately different draft q.
TARGET = torch.tensor(
    [
        [0.40, 0.30, 0.20, 0.10],
        [0.15, 0.15, 0.30, 0.40],
        [0.25, 0.35, 0.15, 0.25],
        [0.30, 0.20, 0.20, 0.30],
        [0.10, 0.20, 0.30, 0.40],
        [0.25, 0.25, 0.25, 0.25],
    ],
    dtype=torch.float64,
)
DRAFT = torch.tensor(
    [
        [0.10, 0.20, 0.30, 0.40],
        [0.50, 0.30, 0.10, 0.10],
        [0.25, 0.05, 0.60, 0.10],
        [0.70, 0.10, 0.10, 0.10],
        [0.40, 0.30, 0.20, 0.10],
        [0.10, 0.60, 0.10, 0.20],
    ],
    dtype=torch.float64,
)


def chi_square_pvalue(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    total = sum(counts.values())
    statistic = sum((counts.get(cell, 0) - total * p) ** 2 / (total * p) for cell, p in probs.items())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(statistic / 2.0)))


def expected_joint() -> dict[tuple[int, ...], float]:
    return {
        cells: float(torch.prod(torch.stack([TARGET[t, x] for t, x in enumerate(cells)])))
        for cells in itertools.product(range(VOCAB), repeat=LENGTH)
    }


def always_accept(target, drafts, draft_probs, generator) -> Verification:
    """A broken verifier: keeps every draft, then a bonus token from p."""
    k = len(drafts)
    bonus = int(torch.multinomial(target[k].float(), 1, generator=generator))
    return Verification([*drafts, bonus], k, [1.0] * k)


def resample_from_target(target, drafts, draft_probs, generator) -> Verification:
    """A subtly broken verifier: right acceptance test, but a rejection redraws from p instead of
    the residual max(p - q, 0), which over-weights the tokens q favours."""
    for j, token in enumerate(drafts):
        if (
            torch.rand(1, generator=generator, dtype=torch.float64).item() * draft_probs[j, token]
            < target[j, token]
        ):
            continue
        return Verification([*drafts[:j], sample_from(target[j], generator)], j, [])
    return Verification([*drafts, sample_from(target[len(drafts)], generator)], len(drafts), [])


def decode(verifier, point_mass: bool, seed: int) -> dict[tuple[int, ...], int]:
    """TRIALS runs of LENGTH tokens; drafts come from q (or, for point masses, a fixed guess)."""
    generator = torch.Generator().manual_seed(seed)
    choose_k = random.Random(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(TRIALS):
        out: list[int] = []
        while len(out) < LENGTH:
            t = len(out)
            k = choose_k.randint(1, 3)
            if point_mass:
                drafts = [(t + j) % VOCAB for j in range(k)]
                draft_probs = None
            else:
                drafts = [
                    int(torch.multinomial(DRAFT[t + j].float(), 1, generator=generator)) for j in range(k)
                ]
                draft_probs = DRAFT[t : t + k]
            result = verifier(TARGET[t : t + k + 1], drafts, draft_probs, generator)
            out.extend(result.token_ids)
        cells = tuple(out[:LENGTH])
        counts[cells] = counts.get(cells, 0) + 1
    return counts


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass"])
def test_rejection_sampling_matches_the_target(point_mass):
    pvalue = chi_square_pvalue(decode(verify_sampled, point_mass, seed=11), expected_joint())
    assert pvalue > 1e-3, f"output distribution differs from the target (p = {pvalue:.2e})"


@pytest.mark.parametrize("broken", [always_accept, resample_from_target])
def test_a_biased_verifier_fails_the_same_test(broken):
    pvalue = chi_square_pvalue(decode(broken, False, seed=11), expected_joint())
    assert pvalue < 1e-6


def decode_confidence_policy(confidence_of, seed: int, trials: int) -> dict[tuple[int, ...], int]:
    """`trials` runs of LENGTH tokens as the confidence policy drafts for sampled requests: up to 3
    drafts from q, each offered with its confidence, drafting stopping once the product of the
    confidences falls below the policy's floor (2 ms per token on a 10 ms step: 0.2)."""
    policy = ConfidencePolicy(StepCostModel(CostCurve([1, 8], [0.010, 0.024])))
    floor = policy.drafting_floor(1, 1.0, 0.0)
    assert floor == pytest.approx(0.2)
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(trials):
        out: list[int] = []
        while len(out) < LENGTH:
            t = len(out)
            request = DraftRequest(None, None, [], floor)  # offer() uses neither item nor row
            while not request.stopped and len(request.token_ids) < 3:
                q = DRAFT[t + len(request.token_ids)]
                token = int(torch.multinomial(q.float(), 1, generator=generator))
                request.offer(token, q, confidence_of(q, token))
            k = len(request.token_ids)
            draft_probs = torch.stack(request.probs) if k else None
            out.extend(
                verify_sampled(TARGET[t : t + k + 1], request.token_ids, draft_probs, generator).token_ids
            )
        cells = tuple(out[:LENGTH])
        counts[cells] = counts.get(cells, 0) + 1
    return counts


def test_the_confidence_policy_keeps_the_target_distribution():
    # 2,000 trials (a third of the others'): the test must stay quick, and the broken variant
    # below fails it by a wide margin (p ~ 1e-9) with half as many.
    counts = decode_confidence_policy(lambda q, token: sampled_confidence(q), seed=11, trials=2000)
    pvalue = chi_square_pvalue(counts, expected_joint())
    assert pvalue > 1e-3, f"output distribution differs from the target (p = {pvalue:.2e})"


def test_stopping_on_the_drawn_tokens_probability_fails_the_same_test():
    """What `sampled_confidence` avoids: a stop that looks at q(drawn token) keeps the drafts q
    over-weights more often than the others, and the outputs drift toward q."""
    counts = decode_confidence_policy(lambda q, token: float(q[token]), seed=11, trials=1000)
    assert chi_square_pvalue(counts, expected_joint()) < 1e-6


def test_acceptance_probability_is_the_overlap_of_p_and_q():
    generator = torch.Generator().manual_seed(0)
    result = verify_sampled(TARGET[:2], [3], DRAFT[:1], generator)
    assert result.accept_probs == pytest.approx([float(torch.minimum(TARGET[0], DRAFT[0]).sum())])
    point = verify_sampled(TARGET[:2], [1], None, generator)
    assert point.accept_probs == pytest.approx([0.30])


def test_draft_the_target_never_picks_is_always_rejected():
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    for seed in range(20):
        result = verify_sampled(target, [2], None, torch.Generator().manual_seed(seed))
        assert result.num_accepted == 0 and result.token_ids == [1]


def test_seeded_verification_is_reproducible():
    runs = [
        verify_sampled(TARGET[:4], [0, 3, 1], DRAFT[:3], torch.Generator().manual_seed(5)).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_greedy_verification():
    assert verify_greedy([4, 7, 9, 2], [4, 7, 9]) == Verification([4, 7, 9, 2], 3, [1.0, 1.0, 1.0])
    assert verify_greedy([4, 8, 9, 2], [4, 7, 9]) == Verification([4, 8], 1, [1.0, 0.0])
    assert verify_greedy([5], []) == Verification([5], 0, [])


def _sequence(params: SamplingParams, output: list[int]) -> Sequence:
    prompt = [10, 11, 12]
    request = EngineRequest("r", prompt, params, eos_token_ids=[0])
    return Sequence(1, request, 0, prompt + output, len(prompt), b"")


def test_position_rows_see_the_drafts_before_them():
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=3, stop_token_ids=[5])
    seq = _sequence(params, output=[7])
    base = SamplingRow(params, [10, 11, 12], [7])
    rows = position_rows(base, seq, [8, 8])
    assert [r.output_token_ids for r in rows] == [[7], [7, 8], [7, 8, 8]]
    # One token generated: positions 0 and 1 would be the 2nd and 3rd, still under min_tokens.
    assert [sorted(r.masked_token_ids) for r in rows] == [[0, 5], [0, 5], []]
    processed = process_logits(torch.zeros(3, 16), rows)
    assert processed[0, 8] == 0.0 and processed[1, 8] == -1.0 and processed[2, 8] == -2.0
    assert processed[0, 0] == float("-inf") and processed[2, 0] == 0.0


def test_verification_uses_the_processed_target_distribution():
    """A logit bias the draft ignores decides the greedy target; logprobs follow the sampler."""
    params = SamplingParams(temperature=0.0, logit_bias={3: 50.0}, logprobs=2)
    seq = _sequence(params, output=[7])
    base = SamplingRow(params, [10, 11, 12], [7])
    rows = position_rows(base, seq, [1, 3])
    logits = torch.zeros(3, 8)
    logits[:, 1] = 5.0
    result, tokens = verify_processed(process_logits(logits, rows), rows, [1, 3], None)
    assert result.token_ids == [3] and result.num_accepted == 0
    assert (
        tokens[0].token_id == 3 and tokens[0].rank == 1 and tokens[0].logprob == pytest.approx(0.0, abs=1e-6)
    )
    assert [t for t, _ in tokens[0].top_logprobs] == [3, 1]


class ForbidAfterFirst:
    """A grammar stand-in: after the first draft, only token 6 is allowed."""

    def position_masks(self, seq, drafts):
        allowed = torch.zeros(8, dtype=torch.bool)
        allowed[6] = True
        return [None] + [allowed] * len(drafts)


def test_grammar_masks_reject_drafts_per_position():
    params = SamplingParams(temperature=0.0)
    seq = _sequence(params, output=[7])
    drafts = [1, 2]
    rows = position_rows(
        SamplingRow(params, [10, 11, 12], [7]), seq, drafts, ForbidAfterFirst().position_masks(seq, drafts)
    )
    logits = torch.zeros(3, 8)
    logits[0, 1] = logits[1, 2] = 5.0  # unconstrained, the target would accept both drafts
    result, _ = verify_processed(process_logits(logits, rows), rows, drafts, None)
    assert result.token_ids == [1, 6] and result.num_accepted == 1
