"""Drafting with a confidence: the draft run stops once verifying more would not pay."""

from __future__ import annotations

import torch

from deepinfer.runner.sampler import SamplingRow
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.speculative.proposer import DraftRequest, draw_drafts
from deepinfer.step import ScheduledSequence


def _request(k: int, threshold: float | None, alphas: list[float]) -> DraftRequest:
    params = SamplingParams(temperature=0.0)
    seq = Sequence(1, EngineRequest("r", [1, 2, 3], params), 0, [1, 2, 3, 4], 3, b"")
    seq.num_computed_tokens = 4 + k
    item = ScheduledSequence(seq, 1 + k, 3, True, num_draft_tokens=k, speculative=True)
    return DraftRequest(item, SamplingRow(params, [1, 2, 3], [4]), alphas, threshold)


def test_offer_stops_when_the_estimate_drops_below_the_threshold():
    request = _request(4, threshold=0.5, alphas=[0.9, 0.9, 0.9, 0.9])
    for token, confidence in [(5, 0.9), (6, 0.8), (7, 0.3), (8, 0.9)]:
        if request.wants_more:
            request.offer(token, None, confidence)
    # (0.9+0.9)/2 = 0.9; x (0.9+0.8)/2 = 0.765; x (0.9+0.3)/2 = 0.459 < 0.5: the third is dropped.
    assert request.token_ids == [5, 6] and request.stopped
    free = _request(4, threshold=None, alphas=[0.1] * 4)
    for token in range(4):
        free.offer(token, None, 0.01)
    assert free.token_ids == [0, 1, 2, 3] and not free.wants_more


def test_draw_drafts_greedy_takes_the_processed_argmax():
    request = _request(2, threshold=None, alphas=[1.0, 1.0])
    logits = torch.zeros(1, 10)
    logits[0, 3] = 4.0
    draw_drafts(logits, [request])
    assert request.token_ids == [3] and request.probs == []
    assert request.confidences[0] == torch.softmax(logits[0], dim=-1)[3].item()


def test_draw_drafts_takes_the_proposers_own_confidences():
    """A proposer with a confidence head hands its values in; they replace the distribution's."""
    greedy = _request(2, threshold=None, alphas=[1.0, 1.0])
    sampled = _request(2, threshold=None, alphas=[1.0, 1.0])
    sampled.base_row.params = SamplingParams(temperature=1.0)
    sampled.base_row.generator = torch.Generator().manual_seed(0)
    logits = torch.zeros(2, 10)
    logits[:, 3] = 4.0
    draw_drafts(logits, [greedy, sampled], [0.25, 0.75])
    assert greedy.token_ids == [3] and greedy.confidences == [0.25]
    assert len(sampled.probs) == 1 and sampled.confidences == [0.75]
