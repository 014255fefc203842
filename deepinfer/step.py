"""A step's plan: which sequences get how many new tokens. Plain data, shared by the scheduler
(which writes it), the runner (which turns it into tensors) and the speculative decoder."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    start: int  # position of the first new token (tokens computed before this step)
    sample: bool  # this step ends at the sequence's last token, so it yields a new token
    forks: list[Sequence] = field(default_factory=list)  # siblings sampled from the same logits
    # Speculative decoding: the last num_draft_tokens of num_new_tokens are draft tokens (filled in
    # by the proposer after allocation), verified by the target in this step's forward.
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    speculative: bool = False  # draft slots were reserved (even if the proposer then used none)

    def truncate_drafts(self, keep: int) -> None:
        """Verify only the first `keep` reserved drafts (the proposer stopped early); the slots
        left unused are released with the rejected ones after the step."""
        drop = self.num_draft_tokens - keep
        self.num_draft_tokens = keep
        self.num_new_tokens -= drop
        self.seq.num_computed_tokens -= drop


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    block_copies: list[tuple[int, int]]
    preempted: list[Sequence]

    def drop_finished(self) -> None:
        """Async scheduling: leave out the sequences that finished after this plan was made (the
        step before it stopped them, or they were aborted); their blocks are already free."""
        self.scheduled = [item for item in self.scheduled if not item.seq.is_finished]
        for item in self.scheduled:
            item.forks = [child for child in item.forks if not child.is_finished]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
