"""Speculative-decoding counters: what was drafted, what was accepted, which lengths were chosen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpecDecodeStats:
    method: str
    length_policy: str
    max_k: int
    num_decode_steps: int = 0  # sequence-steps past the prompt (with or without drafts)
    num_spec_steps: int = 0  # of those, the ones that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_output_tokens: int = 0  # tokens those decode steps produced (accepted drafts + 1 each)
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: steps that verified draft j+1
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps that accepted draft j+1
    chosen_k: list[int] = field(default_factory=list)  # [k]: decode steps that verified k drafts
    cost_model: dict[str, Any] | None = None  # the startup profile (dynamic policy)

    def __post_init__(self) -> None:
        self.drafted_per_position = self.drafted_per_position or [0] * self.max_k
        self.accepted_per_position = self.accepted_per_position or [0] * self.max_k
        self.chosen_k = self.chosen_k or [0] * (self.max_k + 1)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One decode step of one sequence: `num_drafts` verified, `num_accepted` of them kept."""
        self.num_decode_steps += 1
        self.chosen_k[num_drafts] += 1
        self.num_output_tokens += num_accepted + 1
        if num_drafts:
            self.num_spec_steps += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            for j in range(num_drafts):
                self.drafted_per_position[j] += 1
                if j < num_accepted:
                    self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of the steps that verified draft j+1 which accepted it (a rejection earlier in
        the run counts as not accepted)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per step that verified drafts."""
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    @property
    def tokens_per_decode_step(self) -> float:
        return self.num_output_tokens / self.num_decode_steps if self.num_decode_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "length_policy": self.length_policy,
            "max_k": self.max_k,
            "num_decode_steps": self.num_decode_steps,
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_decode_step": self.tokens_per_decode_step,
            "chosen_k": list(self.chosen_k),
            "cost_model": self.cost_model,
        }
