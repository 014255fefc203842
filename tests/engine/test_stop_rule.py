"""The one stop rule (sequence.py) the scheduler and the speculative decoder share."""

from __future__ import annotations

from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, FinishReason, Sequence, draft_room, length_room, stop_after

PROMPT = [5, 6, 7]


def generated(outputs: list[int], **params) -> Sequence:
    """A sequence over PROMPT that has generated `outputs` (eos is token 0)."""
    request = EngineRequest("r", list(PROMPT), SamplingParams(temperature=0.0, **params), eos_token_ids=[0])
    return Sequence(0, request, 0, [*PROMPT, *outputs], len(PROMPT), b"")


def test_eos_and_stop_token_ids_end_a_sequence_past_min_tokens():
    assert stop_after(generated([0]), 0, 100) == (FinishReason.STOP, None)
    assert stop_after(generated([9], stop_token_ids=[9]), 9, 100) == (FinishReason.STOP, 9)
    assert stop_after(generated([0], min_tokens=1), 0, 100) is None
    assert stop_after(generated([1, 0], min_tokens=1), 0, 100) == (FinishReason.STOP, None)
    assert stop_after(generated([0], ignore_eos=True), 0, 100) is None
    assert stop_after(generated([4]), 4, 100) is None


def test_length_limits_end_a_sequence_whatever_min_tokens_says():
    assert stop_after(generated([4, 4], max_tokens=2, min_tokens=5), 4, 100) == (FinishReason.LENGTH, None)
    assert stop_after(generated([4]), 4, len(PROMPT) + 1) == (FinishReason.LENGTH, None)


def test_room_for_new_tokens_and_for_drafts():
    seq = generated([4], max_tokens=5)
    assert length_room(seq, 100) == 4  # max_tokens
    assert length_room(seq, 6) == 2  # the context
    assert draft_room(seq, 100) == 3  # the drafts and the token sampled after them: 4 outputs
    assert draft_room(seq, 6) == 2  # two drafts take positions 4 and 5
    assert length_room(generated([4], max_tokens=None), 10) == 6  # no max_tokens: the context alone
