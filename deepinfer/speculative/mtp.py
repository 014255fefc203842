"""DeepSeek's multi-token-prediction module as the proposer.

MTP row i reads the target's hidden state h_i and the embedding of token i + 1 and predicts token
i + 2; it has its own latent cache (one slot per position, the target's slot layout). So a row can
only run once token i + 1 is known: after a step, the rows the target just computed (accepted
positions only) wait as pending rows with their hidden states and next tokens. At the next step,
after allocation, one MTP forward runs every scheduled sequence's pending rows (the catch-up,
which keeps the MTP cache complete); for a drafting sequence the last pending row is at position
start - 1, next token = the last sampled one, so its logits give draft 1. Further drafts chain the
same module on its own output hidden state in place of the target's (depth 0 reused), writing
positions start .. start + k - 2, which the step reserved. Those chained rows are overwritten
by the real rows once the target has verified their tokens.

Fork children inherit their parent's pending rows with their own sampled token; a preempted
sequence drops its rows and rebuilds them from its recomputed prefill. MTP rows of blocks reused
from the prefix cache are taken as they are: the last row of such a block may have been computed
for another continuation, which can only lower acceptance, never change the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runner.inputs import RowSpan
from deepinfer.runner.kv_caches import CacheView
from deepinfer.runner.sampler import SampledToken
from deepinfer.sequence import Sequence
from deepinfer.speculative.cost_model import CostCurve, profile_curve, synthetic_spans
from deepinfer.speculative.proposer import DraftRequest, draw_drafts
from deepinfer.step import ScheduledSequence, SchedulerOutput

PROFILE_CONTEXT = 64


@dataclass(slots=True)
class _PendingRows:
    start: int  # position of the first row
    hidden: (
        torch.Tensor
    )  # [n, H] (V4: [n, hc_mult, H]) target hidden states of positions start .. start + n - 1
    next_tokens: list[int]  # token at position p + 1 for each row p

    @property
    def end(self) -> int:
        return self.start + len(self.next_tokens)


class MTPProposer:
    name = "mtp"
    has_confidence = True

    def __init__(self, model: torch.nn.Module, caches: CacheView) -> None:
        """`model` has `mtp_draft_logits`; `caches` are its MTP latent caches (one per depth)."""
        self.model = model
        self.caches = caches
        self._pending: dict[int, _PendingRows] = {}

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def _run(
        self, spans: list[RowSpan], previous: list[torch.Tensor], logits_spans: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP over `spans` with the given previous hidden rows; logits and hidden of the last row
        of the spans listed in `logits_spans`."""
        inputs = self.caches.inputs(spans)
        device = self.caches.device
        prev = torch.empty(
            (inputs.input_ids.numel(), *previous[0].shape[1:]), dtype=previous[0].dtype, device=device
        )
        for offset, rows in zip(inputs.offsets, previous):
            prev[offset : offset + rows.shape[0]] = rows
        last = inputs.last_rows(spans)[torch.tensor(logits_spans, dtype=torch.long, device=device)]
        logits, hidden = self.model.mtp_draft_logits(
            inputs.input_ids,
            inputs.positions,
            prev,
            self.caches.tensors[0],
            inputs.meta,
            depth=0,
            logits_rows=last,
        )
        return logits, hidden[last]

    def propose(self, plan: SchedulerOutput, requests: list[DraftRequest]) -> None:
        drafting = {r.seq.seq_id: r for r in requests}
        spans: list[RowSpan] = []
        previous: list[torch.Tensor] = []
        first: list[DraftRequest] = []
        first_spans: list[int] = []
        for item in plan.scheduled:
            pending = self._pending.pop(item.seq.seq_id, None)
            if pending is None:
                continue
            request = drafting.get(item.seq.seq_id)
            if request is not None and pending.end == item.start:
                first.append(request)
                first_spans.append(len(spans))
            spans.append(RowSpan(self.caches.tables(item.seq), pending.start, pending.next_tokens))
            previous.append(pending.hidden)
        ready = {id(r) for r in first}
        for request in requests:
            if id(request) not in ready:  # no hidden state for its last token: nothing to draft from
                request.stopped = True
        if not spans:
            return
        logits, chain_hidden = self._run(spans, previous, first_spans)
        if not first:
            return
        draw_drafts(logits, first)
        hidden_of = {id(r): chain_hidden[i : i + 1] for i, r in enumerate(first)}
        active = [r for r in first if r.wants_more]
        while active:
            spans = [
                RowSpan(self.caches.tables(r.seq), r.item.start + len(r.token_ids) - 1, [r.token_ids[-1]])
                for r in active
            ]
            logits, chain_hidden = self._run(
                spans, [hidden_of[id(r)] for r in active], list(range(len(active)))
            )
            for i, r in enumerate(active):
                hidden_of[id(r)] = chain_hidden[i : i + 1]
            draw_drafts(logits, active)
            active = [r for r in active if r.wants_more]

    def after_step(
        self,
        items: list[ScheduledSequence],
        hidden: torch.Tensor,
        offsets: list[int],
        sampled: dict[int, list[SampledToken]],
    ) -> None:
        for item, offset in zip(items, offsets):
            seq = item.seq
            fed = item.num_new_tokens - item.num_draft_tokens  # real tokens this step
            following = seq.token_ids[item.start + 1 : item.start + fed]
            if item.sample:
                new_tokens = [t.token_id for t in sampled.get(seq.seq_id, [])]
                if not new_tokens:
                    continue
                following = following + new_tokens
            else:
                following = seq.token_ids[item.start + 1 : item.start + fed + 1]
            rows = hidden[offset : offset + len(following)].clone()
            self._pending[seq.seq_id] = _PendingRows(item.start, rows, following)
            for child in item.forks:
                child_tokens = sampled.get(child.seq_id)
                if child_tokens:
                    self._pending[child.seq_id] = _PendingRows(
                        item.start, rows, [*following[:-1], child_tokens[0].token_id]
                    )

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._pending.pop(seq_id, None)

    @torch.inference_mode()
    def profile_round(self, max_rows: int, repeats: int) -> CostCurve | None:
        width = self.model.config.hidden_size
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_rows] or [1]

        def forward(spans: list[RowSpan]) -> None:
            dtype = self.caches.tensors[0].dtype
            zeros = [torch.zeros((1, width), device=self.caches.device, dtype=dtype) for _ in spans]
            self._run(spans, zeros, list(range(len(spans))))

        return profile_curve(
            forward,
            counts,
            lambda rows: synthetic_spans(rows, 1, PROFILE_CONTEXT, self.caches.groups),
            repeats,
        )
