"""The sampler against hand-computed distributions, and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.runner.sampler import (
    Sampler,
    SamplingRow,
    process_logits,
    sample_from,
    sample_rows,
    truncated_probs,
    truncated_probs_batch,
)
from deepinfer.sampling_params import SamplingParams


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt_token_ids=[], output_token_ids=[])


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_temperature_only():
    probs = truncated_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = softmax([v / 0.5 for v in LOGITS.tolist()])
    torch.testing.assert_close(probs, torch.tensor(expected))


def test_top_k_keeps_k_best_and_renormalizes():
    probs = truncated_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    p = softmax([2.0, 1.0])
    torch.testing.assert_close(probs, torch.tensor([p[0], p[1], 0.0, 0.0, 0.0]))


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    full = softmax(LOGITS.tolist())  # [0.5, 0.19, 0.11, 0.07, 0.02] roughly
    top_p = full[0] + full[1] - 1e-3  # the first two tokens are needed to reach it
    probs = truncated_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    kept = [full[0], full[1]]
    torch.testing.assert_close(probs, torch.tensor([kept[0] / sum(kept), kept[1] / sum(kept), 0.0, 0.0, 0.0]))


def test_min_p_drops_tokens_below_fraction_of_the_best():
    full = softmax(LOGITS.tolist())
    probs = truncated_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    kept = [p if p >= 0.3 * full[0] else 0.0 for p in full]
    torch.testing.assert_close(probs, torch.tensor([p / sum(kept) for p in kept]))


def test_top_k_then_top_p_then_min_p_compose():
    probs = truncated_probs(LOGITS, SamplingParams(temperature=2.0, top_k=4, top_p=0.6, min_p=0.1))
    scaled = softmax([v / 2.0 for v in LOGITS.tolist()[:4]])  # top-k 4
    cumulative, kept = 0.0, []
    for p in scaled:  # nucleus over the top-k distribution
        if cumulative < 0.6:
            kept.append(p)
        cumulative += p
    kept = [p for p in kept if p >= 0.1 * kept[0]]
    expected = kept + [0.0] * (5 - len(kept))
    torch.testing.assert_close(probs, torch.tensor([p / sum(kept) for p in expected]))


def test_penalties_and_logit_bias():
    r = SamplingRow(
        SamplingParams(
            repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 3.0}
        ),
        prompt_token_ids=[0],
        output_token_ids=[1, 1, 3],
    )
    out = process_logits(LOGITS[None, :], [r])[0]
    expected = [
        2.0 / 2.0,  # in the prompt: positive logit divided by the repetition penalty
        1.0 / 2.0 - 0.5 * 2 - 0.25,  # generated twice
        0.5,
        0.0 * 2.0 - 0.5 - 0.25,  # zero logit: multiplied (stays 0), then frequency + presence
        -1.0 + 3.0,  # logit bias only
    ]
    torch.testing.assert_close(out, torch.tensor(expected))


def test_processing_never_writes_to_the_logits_it_is_given():
    """Plain greedy rows come back as the logits themselves (no copy); a row that any step
    changes gets a new tensor, and the input keeps its values either way."""
    logits = torch.stack([LOGITS, LOGITS])
    assert process_logits(logits, [row(), row(temperature=0.7)]) is logits
    allowed = torch.tensor([False, True, True, True, True])
    changing = [
        row(logit_bias={4: 3.0}),
        SamplingRow(SamplingParams(repetition_penalty=1.5), prompt_token_ids=[0], output_token_ids=[]),
        SamplingRow(SamplingParams(frequency_penalty=0.5), prompt_token_ids=[], output_token_ids=[1]),
        SamplingRow(SamplingParams(), prompt_token_ids=[], output_token_ids=[], masked_token_ids=[0]),
        SamplingRow(SamplingParams(), prompt_token_ids=[], output_token_ids=[], allowed_mask=allowed),
    ]
    for changed in changing:
        out = process_logits(logits, [row(), changed])
        assert out is not logits and not torch.equal(out[1], LOGITS)
        assert torch.equal(logits, torch.stack([LOGITS, LOGITS]))


def test_min_tokens_masks_stop_ids():
    r = SamplingRow(SamplingParams(), prompt_token_ids=[], output_token_ids=[], masked_token_ids=[0])
    out = process_logits(LOGITS[None, :], [r])[0]
    assert out[0] == float("-inf") and out[1] == 1.0


def test_greedy_and_logprobs_of_the_processed_distribution():
    sampler = Sampler()
    [tok] = sampler(LOGITS[None, :], [row(temperature=0.0, logprobs=2)])
    assert tok.token_id == 0 and tok.rank == 1
    expected = torch.log_softmax(LOGITS, -1)
    assert tok.logprob == pytest.approx(float(expected[0]), abs=1e-6)
    assert [t for t, _ in tok.top_logprobs] == [0, 1]
    [tok] = sampler(LOGITS[None, :], [row(temperature=0.5, logprobs=0, seed=3)])
    assert tok.logprob == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, -1)[tok.token_id]), abs=1e-6)


def test_empirical_distribution_matches_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20000):
        counts[sample_from(probs, generator)] += 1
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.015, rtol=0)
    assert counts[3] == 0


def test_seeded_rows_ignore_their_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()

    def draw(neighbour_seed: int | None):
        seeded = row(temperature=1.0, seed=42)
        seeded.generator = torch.Generator().manual_seed(42)
        tokens = []
        for _ in range(20):
            other = row(temperature=1.0, seed=neighbour_seed)
            if neighbour_seed is not None:
                other.generator = torch.Generator().manual_seed(neighbour_seed)
            tokens.append(sampler(logits[:2], [other, seeded])[1].token_id)
        return tokens

    assert draw(None) == draw(7) == draw(8)


def test_batched_truncation_equals_the_per_row_reference():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    batched = truncated_probs_batch(logits, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batched[i], truncated_probs(logits[i], p))
    alone = truncated_probs_batch(logits[3:4], params[3:4])[0]
    assert torch.equal(alone, batched[3])  # a row's result does not depend on its neighbours


def test_batched_draws_equal_single_draws():
    probs = torch.softmax(torch.randn(4, 100, generator=torch.Generator().manual_seed(4)), -1)
    picks = sample_rows(probs, [torch.Generator().manual_seed(s) for s in range(4)])
    assert picks == [sample_from(probs[i], torch.Generator().manual_seed(i)) for i in range(4)]
