"""Speculative decoding in the engine loop: plan lengths, draft, verify, keep the books.

The engine core calls `plan` before scheduling (draft lengths for decoding sequences), `propose`
once the step's blocks are allocated (drafts into the scheduled items), the runner's forward, and
`verify` after it (tokens for every drafted sequence, added to the step's result). The scheduler
then appends the tokens and rolls the KV back past the rejected drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer.runner.model_runner import StepResult, seed_generator
from deepinfer.runner.sampler import SampledToken, SamplingRow, process_logits
from deepinfer.sequence import Sequence, draft_room
from deepinfer.speculative.confidence_policy import ConfidencePolicy
from deepinfer.speculative.cost_model import StepCostModel
from deepinfer.speculative.length_policy import (
    AcceptanceEstimator,
    Candidate,
    LengthPolicy,
    all_accepted_probs,
)
from deepinfer.speculative.proposer import DraftRequest, Proposer
from deepinfer.speculative.stats import SpecDecodeStats
from deepinfer.speculative.verifier import DraftGrammar, position_rows, verify_processed
from deepinfer.step import SchedulerOutput

# A new sequence starts from the engine-wide average acceptance (itself starting here). The first
# position a step does not verify drifts toward 1 (optimism under uncertainty) at EXPLORE_RATE per
# step, so a sequence that stopped speculating probes again after a few dozen steps, and a probe
# reaches one position further than the last observation: its text may have become predictable.
PRIOR_ACCEPTANCE = 0.6
ENGINE_RATE = 0.05
EXPLORE_RATE = 0.03
# Draft streams of seeded requests are derived from the seed but independent of the target's.
DRAFT_SEED_SALT = 0x5BD1E995


def is_decode_step(seq: Sequence) -> bool:
    """The sequence computes only its last, sampled token: the state in which it may draft.

    Constrained sequences (structured output) do not draft until the grammar matcher is wired to
    `SpeculativeDecoder.grammar` (masks per draft position, accepted tokens fed back)."""
    return (
        seq.num_tokens - seq.num_computed_tokens == 1
        and seq.num_output_tokens > 0
        and not seq.pending_forks
        and seq.grammar is None
    )


class SpeculativeDecoder:
    """`sampling_row` gives a sequence's target sampling row (the runner's), `compute_logits`
    the target's logits of hidden rows; `confidence` (the confidence length policy) chooses the
    verified lengths after drafting, from the drafts' confidences."""

    def __init__(
        self,
        proposer: Proposer,
        policy: LengthPolicy,
        stats: SpecDecodeStats,
        sampling_row: Callable[[Sequence], SamplingRow],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        confidence: ConfidencePolicy | None = None,
    ) -> None:
        self.proposer = proposer
        self.confidence = confidence
        self.sampling_row = sampling_row
        self.compute_logits = compute_logits
        self.policy = policy
        self.max_k = policy.max_k
        self.stats = stats
        self.grammar: DraftGrammar | None = None  # structured output: per-position masks
        self._engine_estimate = AcceptanceEstimator([PRIOR_ACCEPTANCE] * self.max_k, ENGINE_RATE)
        self._estimators: dict[int, AcceptanceEstimator] = {}
        self._draft_generators: dict[int, torch.Generator] = {}
        self._threshold: float | None = None
        self._requests: dict[int, DraftRequest] = {}  # this step's drafting, by seq_id

    def set_cost_model(self, cost: StepCostModel) -> None:
        """Price steps with `cost` from now on (a test's synthetic curve instead of the profile)."""
        self.policy.cost = cost
        if self.confidence is not None:
            self.confidence.cost = cost

    def reset_stats(self) -> None:
        """Start the counters afresh (benchmarks measure after a warm-up)."""
        old = self.stats
        self.stats = SpecDecodeStats(old.method, old.length_policy, old.max_k, cost_model=old.cost_model)

    # -- before the schedule --------------------------------------------------------------------

    def estimator(self, seq_id: int) -> AcceptanceEstimator:
        estimator = self._estimators.get(seq_id)
        if estimator is None:
            estimator = self._estimators[seq_id] = AcceptanceEstimator(self._engine_estimate.alphas)
        return estimator

    def plan(self, running: list[Sequence], max_model_len: int, prefill_tokens: int) -> dict[int, int]:
        """Draft lengths (seq_id -> k > 0) for this step's decoding sequences, given the prompt
        tokens the step will likely also carry (they cost time and yield no output)."""
        candidates = []
        for seq in running:
            if not is_decode_step(seq):
                continue
            bound = min(self.max_k, draft_room(seq, max_model_len))
            if bound > 0:
                bound = self.proposer.available(seq, bound)
            candidates.append(Candidate(seq.seq_id, self.estimator(seq.seq_id).alphas, max(bound, 0)))
        if not candidates:
            return {}
        choice = self.policy.choose(candidates, prefill_tokens)
        dynamic = self.policy.mode == "dynamic" and self.proposer.has_confidence
        self._threshold = choice.verify_threshold if dynamic else None
        return {seq_id: k for seq_id, k in choice.lengths.items() if k > 0}

    # -- around the forward --------------------------------------------------------------------------

    def _draft_row(self, seq: Sequence) -> SamplingRow:
        row = self.sampling_row(seq)
        params = seq.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._draft_generators.get(seq.seq_id)
            if generator is None:
                generator = seed_generator(params.seed ^ DRAFT_SEED_SALT, seq.index)
                self._draft_generators[seq.seq_id] = generator
        return dataclasses.replace(row, generator=generator)

    def propose(self, plan: SchedulerOutput) -> None:
        """Fill the drafts of every item with reserved draft slots (fewer when the proposer stops
        early, or the confidence policy verifies fewer: the item then verifies fewer)."""
        self.proposer.forget([s.seq_id for s in plan.preempted])
        drafting = [item for item in plan.scheduled if item.num_draft_tokens]
        if self.confidence is None:
            requests = [
                DraftRequest(
                    item, self._draft_row(item.seq), self.estimator(item.seq.seq_id).alphas, self._threshold
                )
                for item in drafting
            ]
        else:
            # No history: drafting stops on the confidences alone, below the floor no length pays.
            floor = self.confidence.drafting_floor(
                _base_tokens(plan),
                _base_expected(plan),
                self.confidence.draft_seconds(_rows_per_round([item.num_draft_tokens for item in drafting])),
            )
            requests = [DraftRequest(item, self._draft_row(item.seq), [], floor) for item in drafting]
        self.proposer.propose(plan, requests)
        if self.confidence is not None:
            self._choose_after_drafting(plan, requests)
        for request in requests:
            item = request.item
            if len(request.token_ids) < item.num_draft_tokens:
                item.truncate_drafts(len(request.token_ids))
                del request.probs[len(request.token_ids) :]
            item.draft_token_ids = list(request.token_ids)
        self._requests = {r.seq.seq_id: r for r in requests}

    def _choose_after_drafting(self, plan: SchedulerOutput, requests: list[DraftRequest]) -> None:
        """Truncate greedy requests to the lengths the confidence policy finds best for the step.

        Sampled requests verify what they drafted: a cut chosen from all of a sequence's
        confidences would let the confidence of draft j + 1 (a function of draft j) decide
        whether draft j is verified, and the output would no longer follow the target. Their
        drafting stopped at the floor, a decision that looks only at the drafts before."""
        assert self.confidence is not None
        greedy = [r for r in requests if r.base_row.params.greedy]
        if not greedy:
            return
        sampled = [r for r in requests if not r.base_row.params.greedy]
        rows_per_round = _rows_per_round([len(r.token_ids) for r in requests])
        allocation = self.confidence.allocate(
            [r.confidences for r in greedy],
            _base_tokens(plan) + sum(len(r.token_ids) for r in sampled),
            _base_expected(plan) + sum(sum(all_accepted_probs(r.confidences)) for r in sampled),
            self.confidence.draft_seconds(rows_per_round),
        )
        for request, length in zip(greedy, allocation.lengths):
            request.keep(length)

    def verify(self, result: StepResult) -> None:
        """Add the tokens of every drafted item to `result.sampled` (its last k + 1 rows verify k
        drafts); then the proposer sees the whole step's outcome."""
        assert result.items is not None and result.offsets is not None and result.hidden is not None
        items, offsets, hidden = result.items, result.offsets, result.hidden
        drafted = [(item, offset) for item, offset in zip(items, offsets) if item.num_draft_tokens]
        out: dict[int, list[SampledToken]] = {}
        if drafted:
            index = torch.cat(
                [
                    torch.arange(
                        offset + item.num_new_tokens - item.num_draft_tokens - 1, offset + item.num_new_tokens
                    )
                    for item, offset in drafted
                ]
            ).to(hidden.device)
            rows: list[SamplingRow] = []
            for item, _ in drafted:
                seq = item.seq
                masks = (
                    None if self.grammar is None else self.grammar.position_masks(seq, item.draft_token_ids)
                )
                rows.extend(position_rows(self.sampling_row(seq), seq, item.draft_token_ids, masks))
            processed = process_logits(self.compute_logits(hidden[index]), rows)
            start = 0
            for item, _ in drafted:
                k = item.num_draft_tokens
                request = self._requests.get(item.seq.seq_id)
                probs = torch.stack(request.probs) if request is not None and request.probs else None
                verification, tokens = verify_processed(
                    processed[start : start + k + 1], rows[start : start + k + 1], item.draft_token_ids, probs
                )
                start += k + 1
                out[item.seq.seq_id] = tokens
                self._observe(item.seq.seq_id, verification.accept_probs, k)
        for item in items:
            if (
                item.sample
                and item.num_new_tokens - item.num_draft_tokens == 1
                and item.start >= item.seq.num_prompt_tokens
            ):
                verified = out.get(item.seq.seq_id)
                self.stats.record(item.num_draft_tokens, len(verified) - 1 if verified else 0)
                if not item.num_draft_tokens:
                    self._observe(item.seq.seq_id, [], 0)
        self._requests = {}
        result.sampled.update(out)
        # A proposer that asked the runner for target features (DSpark) keeps those, not `hidden`.
        states = hidden if result.features is None else result.features
        self.proposer.after_step(items, states, offsets, result.sampled)

    def _observe(self, seq_id: int, accept_probs: list[float], num_verified: int) -> None:
        """Positions up to the first rejection are observed; those after it (verified but not
        reached) say nothing; the first one not verified drifts toward acceptance."""
        estimator = self.estimator(seq_id)
        estimator.observe(accept_probs)
        estimator.relax(num_verified, 1.0, EXPLORE_RATE)
        self._engine_estimate.observe(accept_probs)

    def observe_step(self, seconds: float, plan: SchedulerOutput) -> None:
        """Calibrate the dynamic policy's cost model with the measured time of a decode step."""
        cost = self.policy.cost
        items = plan.scheduled
        if cost is None or any(item.num_new_tokens - item.num_draft_tokens != 1 for item in items):
            return  # fixed lengths, or a prefill chunk in the step: not the shape the model prices
        rows = [sum(1 for item in items if item.num_draft_tokens >= r) for r in range(1, self.max_k + 1)]
        cost.observe(seconds, sum(item.num_new_tokens for item in items), rows[0], rows)

    def release(self, seq_ids: list[int]) -> None:
        self.proposer.forget(seq_ids)
        for seq_id in seq_ids:
            self._estimators.pop(seq_id, None)
            self._draft_generators.pop(seq_id, None)


def _base_tokens(plan: SchedulerOutput) -> int:
    """The step's forward tokens other than drafts."""
    return sum(item.num_new_tokens - item.num_draft_tokens for item in plan.scheduled)


def _base_expected(plan: SchedulerOutput) -> float:
    """Output tokens the step yields without drafts: one per sampled sequence."""
    return float(sum(1 + len(item.forks) for item in plan.scheduled if item.sample))


def _rows_per_round(lengths: list[int]) -> list[int]:
    """Rows of each drafting round when the sequences draft these many tokens."""
    return [sum(1 for n in lengths if n >= j) for j in range(1, max(lengths, default=0) + 1)]
