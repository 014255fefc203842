"""A smaller model drafts autoregressively; the target verifies.

The draft model keeps its own paged KV cache, addressed with the target's block tables and slots
(the same blocks, a separate tensor per layer, sized with the target's from the one KV budget),
so the scheduler's allocation covers it: drafting
k tokens writes positions start .. start + k - 1, all reserved for the step's verification.

Catch-up is lazy: the draft remembers up to which position its cache holds the sequence's real
tokens, and the first drafting round feeds everything after that (the accepted tokens of the last
step, or the whole prompt of a new, forked, preempted or prefix-hit sequence) as one chunk ending
at the last token; its logits give the first draft. Each further round feeds one draft. After
verification, positions holding rejected drafts are simply no longer counted.
"""

from __future__ import annotations

import torch

from deepinfer.model.base import CausalLM
from deepinfer.runner.inputs import RowSpan
from deepinfer.runner.kv_caches import CacheView
from deepinfer.runner.model_runner import make_attention_backend, prepare_backend
from deepinfer.runner.sampler import SampledToken
from deepinfer.sequence import Sequence
from deepinfer.speculative.cost_model import CostCurve, profile_curve, synthetic_spans
from deepinfer.speculative.proposer import DraftRequest, draw_drafts
from deepinfer.step import ScheduledSequence, SchedulerOutput

PROFILE_CONTEXT = 64


class DraftModelProposer:
    name = "draft"
    has_confidence = True

    def __init__(self, model: CausalLM, caches: CacheView, attention_backend: str = "auto") -> None:
        self.model = model
        self.caches = caches
        first = caches.groups[0]
        self.backend = make_attention_backend(
            attention_backend, model, first.entries_per_block, caches.device, caches.tensors[0].dtype
        )
        self._computed: dict[int, int] = {}  # seq_id -> leading positions whose draft KV is valid
        self._fed: dict[int, int] = {}  # seq_id -> positions fed this step (valid if accepted)

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def _logits(self, spans: list[RowSpan]) -> torch.Tensor:
        inputs = self.caches.inputs(spans)
        prepare_backend(self.backend, inputs.meta)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.caches.tensors, inputs.meta, self.backend
        )
        return self.model.compute_logits(hidden[inputs.last_rows(spans)])

    def propose(self, plan: SchedulerOutput, requests: list[DraftRequest]) -> None:
        if not requests:
            return
        spans = []
        for request in requests:
            seq, start = request.seq, request.item.start
            done = min(self._computed.get(seq.seq_id, 0), start)
            spans.append(RowSpan(self.caches.tables(seq), done, seq.token_ids[done : start + 1]))
            self._fed[seq.seq_id] = start + 1
        draw_drafts(self._logits(spans), requests)
        active = [r for r in requests if r.wants_more]
        while active:
            spans = [
                RowSpan(self.caches.tables(r.seq), r.item.start + len(r.token_ids), [r.token_ids[-1]])
                for r in active
            ]
            for r in active:
                self._fed[r.seq.seq_id] = r.item.start + len(r.token_ids) + 1
            draw_drafts(self._logits(spans), active)
            active = [r for r in active if r.wants_more]

    def after_step(
        self,
        items: list[ScheduledSequence],
        hidden: torch.Tensor,
        offsets: list[int],
        sampled: dict[int, list[SampledToken]],
    ) -> None:
        for item in items:
            seq_id = item.seq.seq_id
            fed = self._fed.pop(seq_id, None)
            if fed is None:
                continue
            # Positions start + j hold draft j; they count once the target accepted it.
            accepted = len(sampled.get(seq_id, [])) - 1
            self._computed[seq_id] = min(fed, item.start + 1 + max(accepted, 0))

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._computed.pop(seq_id, None)
            self._fed.pop(seq_id, None)

    @torch.inference_mode()
    def profile_round(self, max_rows: int, repeats: int) -> CostCurve | None:
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_rows] or [1]
        return profile_curve(
            self._logits,
            counts,
            lambda rows: synthetic_spans(rows, 1, PROFILE_CONTEXT, self.caches.groups),
            repeats,
        )
