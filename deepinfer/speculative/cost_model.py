"""What a step costs: measured at engine startup, interpolated between the measured points.

The length policy weighs expected accepted tokens against time, so it needs the cost of a target
forward as a function of the step's batch tokens (flat while the hardware is underused, then
rising), the extra cost of verifying a sequence as a multi-token chunk instead of decode rows (a
separate attention call per layer in the CPU backends), and the cost of one drafting round as a
function of the rows it drafts. A few shapes are timed (the minimum of a few interleaved runs) and everything
in between is linear interpolation; beyond the last point the last slope continues. Curves are
made non-decreasing: more tokens never cost less, and a dip is timing noise.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.cache_layout import GroupLayout
from deepinfer.runner.inputs import RowSpan
from deepinfer.utils import cdiv


@dataclass(slots=True)
class CostCurve:
    """Seconds as a piecewise-linear function of a count (tokens or rows)."""

    counts: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        if not self.counts or len(self.counts) != len(self.seconds):
            raise ValueError("a cost curve needs one time per measured count, and at least one point")
        pairs = sorted(zip(self.counts, self.seconds))
        self.counts = [c for c, _ in pairs]
        running = 0.0
        self.seconds = []
        for _, s in pairs:
            running = max(running, s)
            self.seconds.append(running)

    def __call__(self, count: float) -> float:
        xs, ys = self.counts, self.seconds
        if len(xs) == 1:
            return ys[0] * max(count, 1) / max(xs[0], 1)
        if count <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, count), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (count - x0) / (x1 - x0)

    def to_dict(self) -> dict[str, list]:
        return {"counts": list(self.counts), "seconds": list(self.seconds)}


# Weight of one observed step in the running corrections (about the last 20 steps count).
CALIBRATION_RATE = 0.05


@dataclass(slots=True)
class StepCostModel:
    """The startup profile plus two corrections learned from real steps: time every step spends
    outside the profiled forward (scheduling, sampling, outputs), and the extra time per verified
    sequence (its verification rows, the proposer's lookup, the rollback). The profile alone
    underestimates a verifying step, and the policy then speculates where it does not pay."""

    verify: CostCurve  # target forward (with logits at every row) vs batch tokens
    chunk_overhead: float = 0.0  # seconds per sequence verified as a chunk rather than as decode rows
    draft_round: CostCurve | None = None  # one drafting round vs rows drafted; None: drafting is free
    step_overhead: float = 0.0  # seconds of every step outside the forward (learned)

    def step_seconds(self, batch_tokens: int, num_chunked: int, rows_per_round: Sequence[int]) -> float:
        """A step that verifies `num_chunked` sequences with drafts among `batch_tokens` tokens,
        after drafting rounds of the given row counts."""
        seconds = self.verify(max(batch_tokens, 1)) + self.step_overhead + self.chunk_overhead * num_chunked
        if self.draft_round is not None:
            seconds += sum(self.draft_round(rows) for rows in rows_per_round if rows)
        return seconds

    def observe(
        self, seconds: float, batch_tokens: int, num_chunked: int, rows_per_round: Sequence[int]
    ) -> None:
        """Fold in a measured decode step (no prefill in it): a step without drafts updates the
        per-step overhead, one with drafts the per-sequence verification overhead."""
        predicted = self.step_seconds(batch_tokens, 0, rows_per_round) - self.step_overhead
        residual = seconds - predicted
        if num_chunked == 0:
            self.step_overhead += CALIBRATION_RATE * (max(residual, 0.0) - self.step_overhead)
        else:
            per_sequence = max(residual - self.step_overhead, 0.0) / num_chunked
            self.chunk_overhead += CALIBRATION_RATE * (per_sequence - self.chunk_overhead)

    def to_dict(self) -> dict:
        return {
            "verify": self.verify.to_dict(),
            "chunk_overhead_s": self.chunk_overhead,
            "step_overhead_s": self.step_overhead,
            "draft_round": None if self.draft_round is None else self.draft_round.to_dict(),
        }


ForwardFn = Callable[[list[RowSpan]], None]


def time_shapes(forward: ForwardFn, shapes: list[list[RowSpan]], repeats: int) -> list[float]:
    """Seconds of one forward per shape: the minimum over `repeats` rounds, each round timing every
    shape once (after a warm-up round). On a shared machine other work only ever adds time, so
    the minimum is the cost; interleaving spreads a burst of load over all shapes alike."""
    for spans in shapes:
        forward(spans)
    best = [float("inf")] * len(shapes)
    for _ in range(repeats):
        for i, spans in enumerate(shapes):
            begin = time.perf_counter()
            forward(spans)
            best[i] = min(best[i], time.perf_counter() - begin)
    return best


def synthetic_spans(
    num_seqs: int, tokens_each: int, context: int, groups: list[GroupLayout]
) -> list[RowSpan] | None:
    """`num_seqs` sequences of `tokens_each` new tokens after `context` cached ones, each in its own
    blocks of every group (free at startup, so writing their slots disturbs nothing). None if a
    group's pool is too small."""
    per_seq = [cdiv(context + tokens_each, g.block_tokens) for g in groups]
    if any(n * num_seqs > g.num_blocks for n, g in zip(per_seq, groups)):
        return None
    return [
        RowSpan([list(range(i * n, (i + 1) * n)) for n in per_seq], context, [0] * tokens_each)
        for i in range(num_seqs)
    ]


def profile_curve(
    forward: ForwardFn,
    counts: Sequence[int],
    shape: Callable[[int], list[RowSpan] | None],
    repeats: int,
) -> CostCurve:
    measured: list[int] = []
    shapes: list[list[RowSpan]] = []
    for count in counts:
        spans = shape(count)
        if spans is None:
            break
        measured.append(count)
        shapes.append(spans)
    return CostCurve(measured, time_shapes(forward, shapes, repeats))


# Profiles are reused by every engine built on the same weights in a process (tests build many).
_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, object]] = weakref.WeakKeyDictionary()


def cached_profile(owner: torch.nn.Module, key: tuple, build: Callable[[], object]) -> object:
    per_model = _CACHE.setdefault(owner, {})
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]
