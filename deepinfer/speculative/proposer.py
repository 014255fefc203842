"""The Proposer interface: who drafts the tokens the target model verifies.

A step with speculation goes: the length policy picks how many drafts each decoding sequence may
take (`available` bounds it: an n-gram proposer can only offer the continuation it found), the
scheduler reserves that many extra slots, the proposer fills `DraftRequest.token_ids` (drafting
writes only slots the step reserved), the target verifies, and `after_step` tells the proposer
what was accepted so it can keep its own state (draft KV, pending MTP rows) consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from deepinfer.runner.sampler import (
    SampledToken,
    SamplingRow,
    process_logits,
    sample_rows,
    truncated_probs_batch,
)
from deepinfer.sequence import Sequence
from deepinfer.speculative.cost_model import CostCurve
from deepinfer.speculative.verifier import position_row
from deepinfer.step import ScheduledSequence, SchedulerOutput


@dataclass(slots=True, eq=False)
class DraftRequest:
    """One sequence's drafting this step."""

    item: ScheduledSequence  # item.num_draft_tokens slots are reserved
    base_row: SamplingRow  # the sequence's sampling row, with the draft's own generator
    alphas: list[float]  # estimated acceptance per draft position (history; empty: none)
    threshold: float | None = None  # stop once the estimated P(all drafts so far pass) drops below
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q per draft; empty: point masses
    # Per draft, in [0, 1]: the proposer's estimate that it is accepted once the drafts before it
    # were; a function of the drafts before it only (see `sampled_confidence`).
    confidences: list[float] = field(default_factory=list)
    stopped: bool = False
    _all_pass: float = 1.0

    @property
    def seq(self) -> Sequence:
        return self.item.seq

    @property
    def wants_more(self) -> bool:
        return not self.stopped and len(self.token_ids) < self.item.num_draft_tokens

    def next_row(self) -> SamplingRow:
        return position_row(self.base_row, self.seq, self.token_ids)

    def offer(self, token: int, probs: torch.Tensor | None, confidence: float) -> None:
        """Take a drafted token unless the confidence-adjusted estimate says verifying it does
        not pay; the estimate of a position averages its history and the draft's own probability."""
        j = len(self.token_ids)
        if self.threshold is not None:
            alpha = 0.5 * (self.alphas[j] + confidence) if j < len(self.alphas) else confidence
            if self._all_pass * alpha < self.threshold:
                self.stopped = True
                return
            self._all_pass *= alpha
        self.token_ids.append(token)
        self.confidences.append(confidence)
        if probs is not None:
            self.probs.append(probs)

    def keep(self, count: int) -> None:
        """Verify only the first `count` drafts (mutates the drafts, their q and confidences)."""
        del self.token_ids[count:], self.probs[count:], self.confidences[count:]


def sampled_confidence(q: torch.Tensor) -> float:
    """The confidence of a draft sampled from q [V]: sum_x q(x)^2, the expected value of q at its
    own draw. It depends on q alone (so on the drafts before it), never on the token drawn: a
    decision to verify a draft that looked at q(drawn token) would keep a draft more often where
    q over-weights it, and the output would no longer follow the target."""
    return float(torch.dot(q, q))


def draw_drafts(
    logits: torch.Tensor, requests: list[DraftRequest], confidences: list[float] | None = None
) -> None:
    """Draft one token per request from draft logits [N, V], processed like the target's rows:
    greedy requests take the argmax, sampled ones draw from q with the draft's generator.
    `confidences` [N]: the proposer's own (a head trained for it, such as DSpark's), which must
    depend on the drafts before this one only; without them, greedy drafts take the argmax's
    probability and sampled ones `sampled_confidence`."""
    rows = [r.next_row() for r in requests]
    processed = process_logits(logits, rows)
    # Sampled rows are truncated and drawn in one batch, exactly as the sampler does.
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    draws: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (token, q [V])
    if drawn:
        q = truncated_probs_batch(processed[drawn], [rows[i].params for i in drawn])
        draws = dict(zip(drawn, zip(sample_rows(q, [rows[i].generator for i in drawn]), q)))
    for i, (request, row) in enumerate(zip(requests, rows)):
        token, probs = (int(processed[i].argmax()), None) if row.params.greedy else draws[i]
        if confidences is not None:
            confidence = confidences[i]
        elif probs is None:
            confidence = float(torch.softmax(processed[i], dim=-1)[token])
        else:
            confidence = sampled_confidence(probs)
        request.offer(token, probs, confidence)


class Proposer(Protocol):
    name: str
    # True when every draft comes with a confidence (draft model, MTP, DSpark): the dynamic policy may stop
    # drafting early, and the confidence policy chooses lengths from them.
    has_confidence: bool

    def available(self, seq: Sequence, limit: int) -> int:
        """How many drafts (<= limit) this proposer can offer `seq` this step."""
        ...

    def propose(self, plan: SchedulerOutput, requests: list[DraftRequest]) -> None:
        """Fill each request's drafts (at most item.num_draft_tokens; fewer ends the run early)."""
        ...

    def after_step(
        self,
        items: list[ScheduledSequence],
        hidden: torch.Tensor,
        offsets: list[int],
        sampled: dict[int, list[SampledToken]],
    ) -> None:
        """After the target forward: `hidden` [T, H] of the step (the target features the runner
        keeps for the proposer when it asked for some: DSpark's), `offsets[i]` the first row of
        items[i], `sampled` the tokens each sampling sequence got (accepted drafts included)."""
        ...

    def forget(self, seq_ids: list[int]) -> None:
        """Drop per-sequence state (finished, aborted or preempted sequences)."""
        ...

    def profile_round(self, max_rows: int, repeats: int) -> CostCurve | None:
        """Seconds of one drafting round vs the rows it drafts (None: drafting costs nothing)."""
        ...
