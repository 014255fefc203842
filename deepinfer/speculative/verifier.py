"""Verify draft tokens against the target model without changing what the target would produce.

Greedy: a draft is accepted while it equals the target's argmax at its position; the first
mismatch is replaced by the argmax, and when all drafts pass the argmax after the last one is the
bonus token. The output is exactly what plain greedy decoding gives.

Sampled (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): draft x drawn from q is
accepted with probability min(1, p(x) / q(x)); on rejection the token is drawn from
normalize(max(p - q, 0)); when every draft passes, a bonus token is drawn from p at the next
position. Each output token is then distributed exactly as p. A proposal without a distribution
(n-gram) is a point mass: accept with probability p(x), else draw from p with x removed.

p is the target's final sampling distribution at each position: the sampler's own processing
(logit bias, min_tokens masks, penalties that see the drafts before the position, structured-output
masks, temperature, top-k, top-p, min-p), applied per position through `position_rows`. Uniform
draws come from the sequence's generator, so a seeded request is reproducible whatever shares the
batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.runner.sampler import SampledToken, SamplingRow, sample_from, truncated_probs_batch
from deepinfer.sequence import Sequence as EngineSequence


@dataclass(slots=True)
class Verification:
    token_ids: list[int]  # the accepted drafts, then one token from the target
    num_accepted: int
    accept_probs: list[float]  # acceptance probability of each draft position the step reached


class DraftGrammar(Protocol):
    """Hook for structured output: the allowed-token masks of a constrained sequence at positions
    0..len(drafts), the mask at position j being the grammar's state after accepting drafts[:j]
    (None where unconstrained). The matcher must not advance here; it advances on accepted tokens.
    A draft the grammar forbids gets p(x) = 0 and is rejected like any other."""

    def position_masks(self, seq: EngineSequence, drafts: Sequence[int]) -> list[torch.Tensor | None]: ...


def position_row(
    base: SamplingRow, seq: EngineSequence, prefix: Sequence[int], mask: torch.Tensor | None = None
) -> SamplingRow:
    """The sampling row for the token after `prefix` (drafts not yet verified): its penalties count
    the prefix as output, and min_tokens masks stop tokens while fewer than min_tokens would have
    been generated before it."""
    params = seq.params
    masked: list[int] = []
    if seq.num_output_tokens + len(prefix) < params.min_tokens:
        masked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(seq.request.eos_token_ids))
    row = dataclasses.replace(
        base, output_token_ids=list(base.output_token_ids) + list(prefix), masked_token_ids=masked
    )
    if mask is not None:
        row.allowed_mask = mask
    return row


def position_rows(
    base: SamplingRow,
    seq: EngineSequence,
    drafts: Sequence[int],
    masks: Sequence[torch.Tensor | None] | None = None,
) -> list[SamplingRow]:
    """Rows for positions 0..len(drafts): row j decides the token after drafts[:j]."""
    return [
        position_row(base, seq, drafts[:j], None if masks is None else masks[j])
        for j in range(len(drafts) + 1)
    ]


def verify_greedy(target_argmax: Sequence[int], drafts: Sequence[int]) -> Verification:
    """target_argmax[j]: the target's choice at position j, for j = 0..len(drafts)."""
    for j, token in enumerate(drafts):
        if int(target_argmax[j]) != token:
            return Verification([*drafts[:j], int(target_argmax[j])], j, [1.0] * j + [0.0])
    k = len(drafts)
    return Verification([*drafts, int(target_argmax[k])], k, [1.0] * k)


def _uniform(generator: torch.Generator | None) -> float:
    return torch.rand(1, generator=generator, dtype=torch.float64).item()


def verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, V] final distributions at positions 0..k
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,  # [k, V] distributions the drafts were drawn from; None: point masses
    generator: torch.Generator | None,
) -> Verification:
    accept_probs: list[float] = []
    out: list[int] = []
    for j, token in enumerate(drafts):
        p = target_probs[j].double()
        if draft_probs is None:
            q_token = 1.0
            accept_probs.append(float(p[token]))
        else:
            q = draft_probs[j].double()
            q_token = float(q[token])
            accept_probs.append(float(torch.minimum(p, q).sum()))
        p_token = float(p[token])
        if q_token > 0.0 and _uniform(generator) * q_token < p_token:
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[j].double()).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p
        out.append(sample_from(residual, generator))
        return Verification(out, j, accept_probs)
    out.append(sample_from(target_probs[len(drafts)].double(), generator))
    return Verification(out, len(drafts), accept_probs)


def with_logprobs(token: int, processed: torch.Tensor, row: SamplingRow) -> SampledToken:
    """The sampler's logprob report for one token: log_softmax of the processed logits divided by
    the temperature (1 for greedy), before top-k/top-p/min-p truncation."""
    sampled = SampledToken(token)
    if row.params.logprobs is None:
        return sampled
    temperature = row.params.temperature if row.params.temperature > 0 else 1.0
    logprobs = torch.log_softmax(processed / temperature, dim=-1)
    sampled.logprob = float(logprobs[token])
    sampled.rank = int((logprobs > logprobs[token]).sum()) + 1
    if row.params.logprobs:
        top = torch.topk(logprobs, row.params.logprobs)
        sampled.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
    return sampled


def verify_processed(
    processed: torch.Tensor,  # [k + 1, V] target logits at positions 0..k after process_logits(rows)
    rows: list[SamplingRow],  # position_rows for the drafts
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,  # [k, V], or None for point masses (and greedy rows)
) -> tuple[Verification, list[SampledToken]]:
    """Verify one sequence's drafts and report its output tokens the way the sampler would."""
    params = rows[0].params
    if params.greedy:
        result = verify_greedy(processed.argmax(dim=-1).tolist(), drafts)
    else:
        target = truncated_probs_batch(processed, [params] * len(rows))  # [k + 1, V]
        result = verify_sampled(target, drafts, draft_probs, rows[0].generator)
    tokens = [with_logprobs(t, processed[j], rows[j]) for j, t in enumerate(result.token_ids)]
    return result, tokens
