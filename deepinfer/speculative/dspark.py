"""DSpark drafting (DeepSeek-V4.1's draft layers, model/deepseek_v4/v41_dspark.py): one non-causal block
forward gives every draft position's hidden state, then the drafts are drawn in order, each with
the Markov correction of the draft before it, each with the confidence head's estimate.

`draft` is the step on explicit tensors; `DSparkProposer` is the same step behind the Proposer
interface, keeping each sequence's feature window between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v4.v41_dspark import DSparkV41
from deepinfer.runner.sampler import SampledToken
from deepinfer.sequence import Sequence
from deepinfer.speculative.cost_model import CostCurve
from deepinfer.speculative.proposer import DraftRequest, draw_drafts
from deepinfer.step import ScheduledSequence, SchedulerOutput


@torch.inference_mode()
def draft(
    drafter: DSparkV41,
    target_features: torch.Tensor,  # [S, W, n * hidden]: positions p - W .. p - 1 (drafter.window)
    last_tokens: torch.Tensor,  # [S] the last token of each sequence (not yet run by the target)
    last_positions: torch.Tensor,  # [S] its position p
    num_drafts: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [S, k] (positions p + 1 ..), confidences [S, k]
    """Greedy (temperature 0: the argmax of the corrected logits) or sampled from
    softmax(logits / temperature) with `generator`. `num_drafts` is the block's length: the
    block is non-causal, so a shorter block drafts differently (DeepSeek, like the proposer, runs
    a fixed one). Feature rows at negative positions are ignored (any values)."""
    if num_drafts < 1:
        raise ValueError(f"num_drafts={num_drafts}: at least one draft")
    positions, visible = drafter.window(last_positions)
    if target_features.shape[:2] != positions.shape:
        raise ValueError(
            f"target features {tuple(target_features.shape)}: expected [S, W={positions.shape[1]}, ...] rows"
        )
    context = drafter.context_keys(target_features, positions)
    hidden = drafter.block_hidden(last_tokens, last_positions, context, visible, num_drafts)
    base = drafter.logits(hidden)  # [S, k, vocab]
    tokens = torch.empty(last_tokens.shape[0], num_drafts, dtype=torch.long, device=last_tokens.device)
    confidences = torch.empty(tokens.shape, device=last_tokens.device)
    previous = last_tokens
    for j in range(num_drafts):
        embedding, correction = drafter.markov(previous)
        confidences[:, j] = drafter.confidence(hidden[:, j], embedding, j)
        logits = base[:, j] + correction
        if temperature == 0.0:
            tokens[:, j] = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tokens[:, j] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        previous = tokens[:, j]
    return tokens, confidences


@dataclass(slots=True)
class _Features:
    first: int  # position of rows[0]
    rows: torch.Tensor  # [n, n_targets * hidden] target features of positions first .. first + n - 1

    @property
    def end(self) -> int:
        return self.first + self.rows.shape[0]


class DSparkProposer:
    """`speculative_method="dspark"` against the Proposer interface. Per sequence it keeps the
    target features of the last W positions the target computed and kept (prompt rows, the real
    token and accepted drafts of each step); a drafting round runs one block of `block_size`
    positions for every drafting sequence (whatever it will verify, so its drafts never depend on
    how many were asked for), then draws each sequence's drafts in order with the Markov
    correction and hands the confidence head's value with each draft.

    `speculative_method="dspark"` (build.py) has the runner keep every step's target features
    [T, n_targets * hidden] (DeepseekV41ForCausalLM's `features` of `target_layer_ids`,
    concatenated as DSparkV41.target_features does) and hand them to `after_step` as `hidden`.
    Rows the target never computed for this sequence (a prefix-cache hit) are left out of the
    context: only acceptance suffers.
    """

    name = "dspark"
    has_confidence = True

    def __init__(self, drafter: DSparkV41) -> None:
        self.drafter = drafter
        self._features: dict[int, _Features] = {}

    def available(self, seq: Sequence, limit: int) -> int:
        return min(limit, self.drafter.spec.block_size)

    @torch.inference_mode()
    def propose(self, plan: SchedulerOutput, requests: list[DraftRequest]) -> None:
        ready: list[DraftRequest] = []
        for request in requests:
            known = self._features.get(request.seq.seq_id)
            if known is None or known.end != request.item.start:
                request.stopped = True  # no features up to its last token: nothing to draft from
            else:
                ready.append(request)
        if not ready:
            return
        drafter, block = self.drafter, self.drafter.spec.block_size
        device = drafter.main_proj.device
        last_positions = torch.tensor([r.item.start for r in ready], device=device)
        last_tokens = torch.tensor([r.seq.token_ids[r.item.start] for r in ready], device=device)
        positions, visible = drafter.window(last_positions)
        features = torch.zeros((*positions.shape, drafter.main_proj.shape[1]), device=device)
        for i, request in enumerate(ready):
            known = self._features[request.seq.seq_id]
            have = positions[i] >= known.first
            visible[i] &= have
            features[i, have] = known.rows[positions[i, have] - known.first]
        context = drafter.context_keys(features, positions)
        hidden = drafter.block_hidden(last_tokens, last_positions, context, visible, block)
        base = drafter.logits(hidden)  # [S, B, vocab]
        for j in range(block):
            active = [i for i, r in enumerate(ready) if r.wants_more]
            if not active:
                return
            previous = torch.tensor(
                [ready[i].token_ids[-1] if j else int(last_tokens[i]) for i in active], device=device
            )
            embedding, correction = drafter.markov(previous)
            confidences = drafter.confidence(hidden[active, j], embedding, j)
            draw_drafts(base[active, j] + correction, [ready[i] for i in active], confidences.tolist())

    def after_step(
        self,
        items: list[ScheduledSequence],
        hidden: torch.Tensor,
        offsets: list[int],
        sampled: dict[int, list[SampledToken]],
    ) -> None:
        """`hidden`: the step's target features [T, n_targets * hidden] (see the class)."""
        window = self.drafter.arch.sliding_window
        for item, offset in zip(items, offsets):
            seq_id = item.seq.seq_id
            kept = item.num_new_tokens - item.num_draft_tokens  # the real tokens
            if item.sample:
                kept += max(len(sampled.get(seq_id, [])) - 1, 0)  # and the accepted drafts
            rows = hidden[offset : offset + kept]
            known = self._features.get(seq_id)
            if known is not None and known.end == item.start:
                rows = torch.cat((known.rows, rows))
                first = known.first
            else:  # a new, preempted or prefix-hit sequence: start over from this step's rows
                first = item.start
            drop = max(rows.shape[0] - window, 0)
            state = _Features(first + drop, rows[drop:].clone())
            self._features[seq_id] = state
            for child in item.forks:  # same tokens before the last one: same features
                self._features[child.seq_id] = state

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._features.pop(seq_id, None)

    @torch.inference_mode()
    def profile_round(self, max_rows: int, repeats: int) -> CostCurve | None:
        """A drafting round of n sequences, timed as a whole drafting (the block and its heads)
        spread over the block's positions: the policies count one round per draft."""
        drafter, block = self.drafter, self.drafter.spec.block_size
        device = drafter.main_proj.device
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_rows] or [1]
        window = drafter.arch.sliding_window

        def forward(count: int) -> None:
            features = torch.zeros((count, window, drafter.main_proj.shape[1]), device=device)
            last = torch.zeros(count, dtype=torch.long, device=device)
            draft(drafter, features, last, last + window, block)

        seconds = []
        for count in counts:
            forward(count)  # warm-up
            best = float("inf")
            for _ in range(repeats):
                begin = time.perf_counter()
                forward(count)
                best = min(best, time.perf_counter() - begin)
            seconds.append(best / block)
        return CostCurve(counts, seconds)
