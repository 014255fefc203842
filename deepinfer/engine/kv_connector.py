"""The seam between the device KV cache and KV that lives elsewhere: a store shared by every
engine (the host tier, a directory, Redis) today, and another engine's cache (prefill/decode
disaggregation) beside it. The engine core calls a connector explicitly, at fixed points of the
step; the scheduler and the KV manager never call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from deepinfer.sequence import Sequence


class KVConnector(Protocol):
    def prefetch(self, seq: Sequence) -> None:
        """A request arrived: start bringing in what is held elsewhere beyond the device's prefix
        hits. May add to `seq.num_pending` (the scheduler admits it only at 0)."""
        ...

    def poll(self) -> None:
        """Before scheduling: install every finished load into free device blocks (indexed in the
        prefix cache, so admission sees ordinary hits) and release its sequence's wait."""
        ...

    def save_completed(self, seqs: Iterable[Sequence]) -> dict[str, str]:
        """After the step's update: hand the newly completed, indexed blocks of `seqs` (finished
        ones included: their freed blocks are still indexed) to wherever they go. Returns the
        requests it failed for (request_id -> why); the engine ends those, nothing else."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def close(self, timeout_s: float) -> None:
        """Flush what is queued, for at most `timeout_s`, and stop its threads."""
        ...
