from __future__ import annotations

import random

import numpy as np
import pytest

from deepinfer.bench.stats import (
    Slo,
    count_good,
    meets_slo,
    percentile,
    summarize,
    time_per_output_token,
    time_weighted_percentile,
)


@pytest.mark.parametrize("size", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(size: int) -> None:
    rng = random.Random(size)
    values = [rng.lognormvariate(0, 1) for _ in range(size)]
    for q in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summarize_matches_numpy() -> None:
    values = [0.5, 3.0, 1.25, 8.0, 2.0, 2.0, 7.5]
    summary = summarize(values)
    assert summary is not None
    assert summary.count == len(values)
    assert summary.mean == pytest.approx(np.mean(values))
    assert summary.std == pytest.approx(np.std(values))
    assert (summary.min, summary.max) == (0.5, 8.0)
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert getattr(summary, name) == pytest.approx(np.percentile(values, q))


def test_summarize_nothing_is_none() -> None:
    assert summarize([]) is None


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    # 1.0 s end to end, first token at 0.1 s, 10 tokens: 9 gaps share 0.9 s.
    assert time_per_output_token(1.0, 0.1, 10) == pytest.approx(0.1)
    assert time_per_output_token(2.0, 0.5, 4) == pytest.approx(0.5)
    assert time_per_output_token(1.0, 0.1, 1) is None
    assert time_per_output_token(1.0, 0.1, 0) is None


def test_goodput_counts_requests_meeting_every_set_objective() -> None:
    slo = Slo(ttft_s=0.2, tpot_s=0.05)
    samples = [
        (0.1, 0.04, 1.0),  # good
        (0.2, 0.05, 9.0),  # good: limits are inclusive, e2e unconstrained
        (0.3, 0.01, 1.0),  # TTFT too slow
        (0.1, 0.06, 1.0),  # TPOT too slow
        (0.1, None, 0.1),  # one output token: no TPOT, passes on TTFT
        (None, None, 0.1),  # never produced a token
    ]
    assert count_good(slo, samples) == 3
    assert count_good(Slo(e2e_s=1.0), samples) == 5
    assert not Slo().is_set()
    assert meets_slo(Slo(), 10.0, 10.0, 10.0)


def test_time_weighted_percentile_weighs_each_gap_by_its_length() -> None:
    gaps = [0.05] * 1000 + [50.0]  # one stall among a thousand short gaps
    assert percentile(gaps, 99.0) == pytest.approx(0.05)
    assert time_weighted_percentile(gaps, 99.0) == 50.0  # the stall is half the waiting time
    assert time_weighted_percentile(gaps, 40.0) == 0.05
    assert time_weighted_percentile([1.0, 2.0, 3.0], 50.0) == 2.0  # 1+2 reach half of 6
    with pytest.raises(ValueError):
        time_weighted_percentile([], 50.0)
