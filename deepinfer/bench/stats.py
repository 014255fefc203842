"""Latency statistics shared by every benchmark: percentiles, summaries, TPOT, goodput.

Pure Python on purpose: the offline benchmarks and the load generator both use it, and it
must agree with numpy's default ("linear") percentile so numbers compare with other tools.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    Matches ``numpy.percentile(values, q)`` (method="linear").
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@dataclass(slots=True)
class Summary:
    """Mean, spread and tail of one metric; ``count`` is how many values it was made of."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(values: Iterable[float]) -> Summary | None:
    """Summary of the values, or None when there are none (a metric that was not observed)."""
    data = [float(v) for v in values]
    if not data:
        return None
    mean = sum(data) / len(data)
    variance = sum((v - mean) ** 2 for v in data) / len(data)
    return Summary(
        count=len(data),
        mean=mean,
        std=math.sqrt(variance),
        min=min(data),
        max=max(data),
        p50=percentile(data, 50.0),
        p90=percentile(data, 90.0),
        p99=percentile(data, 99.0),
    )


def time_weighted_percentile(gaps: Sequence[float], q: float) -> float:
    """The gap below which q% of the total waiting time lies: each gap weighs its own length.

    Inter-token gaps seen per gap let a stream stalled for 50 s count once among thousands of
    short gaps of streams that kept running; weighted by time, the stall counts for the 50 s a
    user waited. Pure data: the smallest gap g such that the gaps no longer than g add up to at
    least q% of the sum.
    """
    if not gaps:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(gaps)
    target = sum(ordered) * q / 100.0
    waited = 0.0
    for gap in ordered:
        waited += gap
        if waited >= target:
            return gap
    return ordered[-1]


def time_per_output_token(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """TPOT = (e2e − ttft) / (output_tokens − 1): the mean gap between tokens after the first.

    Undefined (None) for fewer than two output tokens: there is no decode gap to measure.
    """
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


@dataclass(slots=True)
class Slo:
    """Service-level objectives in seconds; None means that dimension is not constrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def is_set(self) -> bool:
        return any(limit is not None for limit in (self.ttft_s, self.tpot_s, self.e2e_s))


def meets_slo(slo: Slo, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
    """Whether one successful request meets every objective that is set.

    A request with a single output token has no TPOT; it passes the TPOT objective, since it
    spent no time decoding (the TTFT objective still judges it).
    """
    if slo.ttft_s is not None and (ttft_s is None or ttft_s > slo.ttft_s):
        return False
    if slo.tpot_s is not None and tpot_s is not None and tpot_s > slo.tpot_s:
        return False
    return not (slo.e2e_s is not None and (e2e_s is None or e2e_s > slo.e2e_s))


def count_good(slo: Slo, samples: Iterable[tuple[float | None, float | None, float | None]]) -> int:
    """How many (ttft, tpot, e2e) samples of successful requests meet the SLO."""
    return sum(1 for ttft, tpot, e2e in samples if meets_slo(slo, ttft, tpot, e2e))
