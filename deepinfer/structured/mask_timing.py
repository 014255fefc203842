"""What constrained decoding costs on the engine step: process-wide counters, cheap enough to stay on.

Per constrained token the step pays three things: computing the sequence's allowed-token mask
(`GrammarBackend.fill_bitmasks`), applying it to the logits (`apply_bitmask_`) and advancing the
matcher by the sampled token (`GrammarMatcher.accept_token`). Each call adds its wall time here:
two `perf_counter` reads (about 0.1 us) against tens of microseconds of work. On a GPU, `apply`
measures the kernel launches only (they run asynchronously).

The counters are a process-wide metric, like a Prometheus counter: the engine step runs on one
thread, and readers (`deepinfer bench structured`) take a `snapshot()` before and after a run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MaskTiming:
    fill_s: float = 0.0  # in fill_bitmasks
    rows_filled: int = 0  # mask rows computed: one per constrained sampled token
    apply_s: float = 0.0  # in apply_bitmask_
    accept_s: float = 0.0  # in accept_token
    tokens_accepted: int = 0

    def snapshot(self) -> MaskTiming:
        return MaskTiming(self.fill_s, self.rows_filled, self.apply_s, self.accept_s, self.tokens_accepted)

    def since(self, earlier: MaskTiming) -> MaskTiming:
        """What was counted after `earlier` (a snapshot)."""
        return MaskTiming(
            self.fill_s - earlier.fill_s,
            self.rows_filled - earlier.rows_filled,
            self.apply_s - earlier.apply_s,
            self.accept_s - earlier.accept_s,
            self.tokens_accepted - earlier.tokens_accepted,
        )

    def per_token_us(self) -> dict[str, float]:
        """Microseconds per constrained token: fill, apply, their sum (the mask time) and accept."""
        rows = max(self.rows_filled, 1)
        fill, apply = 1e6 * self.fill_s / rows, 1e6 * self.apply_s / rows
        return {
            "fill": fill,
            "apply": apply,
            "mask": fill + apply,
            "accept": 1e6 * self.accept_s / max(self.tokens_accepted, 1),
        }


MASK_TIMING = MaskTiming()
