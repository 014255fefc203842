"""Prompt lookup: propose what followed the last time the sequence's latest n tokens appeared.

No model and no distribution: text that repeats its prompt or itself (code edits, quoting,
summaries that copy names, JSON) is matched against its own prompt + output. The longest n in
[min_n, max_n] with an earlier occurrence wins, and among its occurrences the most recent one,
which tracks text that is being repeated right now.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.runner.sampler import SampledToken
from deepinfer.sequence import Sequence
from deepinfer.speculative.cost_model import CostCurve
from deepinfer.speculative.proposer import DraftRequest
from deepinfer.step import ScheduledSequence, SchedulerOutput


def ngram_continuation(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (min_n <= n <= max_n) of `token_ids`; [] when none occurs earlier."""
    if k <= 0 or len(token_ids) < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Candidate starts i need i + n <= len - 1: an occurrence that ends before the suffix's last
    # token, so at least one token follows it.
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"
    has_confidence = False

    def __init__(self, min_n: int, max_n: int) -> None:
        """1 <= min_n <= max_n (checked by SpeculativeConfig)."""
        self.min_n, self.max_n = min_n, max_n
        self._proposals: dict[int, list[int]] = {}

    def available(self, seq: Sequence, limit: int) -> int:
        proposal = ngram_continuation(seq.token_ids, self.min_n, self.max_n, limit)
        self._proposals[seq.seq_id] = proposal
        return len(proposal)

    def propose(self, plan: SchedulerOutput, requests: list[DraftRequest]) -> None:
        for request in requests:
            proposal = self._proposals.pop(request.seq.seq_id, [])
            request.token_ids = proposal[: request.item.num_draft_tokens]
            request.confidences = [1.0] * len(request.token_ids)
        self._proposals.clear()

    def after_step(
        self,
        items: list[ScheduledSequence],
        hidden: torch.Tensor,
        offsets: list[int],
        sampled: dict[int, list[SampledToken]],
    ) -> None:
        return None

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._proposals.pop(seq_id, None)

    def profile_round(self, max_rows: int, repeats: int) -> CostCurve | None:
        return None
