"""Prompt-lookup proposals."""

from __future__ import annotations

import pytest

from deepinfer.config import SpeculativeConfig
from deepinfer.speculative.ngram import ngram_continuation


def test_longest_suffix_match_wins():
    # Suffix [3, 4] occurs after 1; the longer suffix [2, 3, 4] only at the start.
    tokens = [2, 3, 4, 5, 6, 9, 3, 4, 7, 2, 3, 4]
    assert ngram_continuation(tokens, 1, 3, 3) == [5, 6, 9]
    assert ngram_continuation(tokens, 1, 2, 3) == [7, 2, 3]  # most recent [3, 4]


def test_most_recent_occurrence_and_k_bound():
    tokens = [1, 2, 8, 1, 2, 9, 9, 1, 2]
    assert ngram_continuation(tokens, 2, 2, 1) == [9]
    assert ngram_continuation(tokens, 2, 2, 10) == [9, 9, 1, 2]


def test_no_match_and_degenerate_inputs():
    assert ngram_continuation([1, 2, 3, 4], 2, 3, 5) == []
    assert ngram_continuation([1], 1, 3, 5) == []
    assert ngram_continuation([1, 1], 1, 3, 0) == []
    assert ngram_continuation([5, 5, 5], 1, 4, 3) == [5]  # periodic text proposes its period


def test_ngram_options_are_validated_by_the_config():
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        SpeculativeConfig(speculative_method="ngram", speculative_ngram_min=0, speculative_ngram_max=3)
    with pytest.raises(ValueError, match="speculative_ngram_max"):
        SpeculativeConfig(speculative_method="ngram", speculative_ngram_min=3, speculative_ngram_max=2)
