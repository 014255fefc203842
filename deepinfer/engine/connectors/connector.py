"""The seam between the device KV cache and KV that lives elsewhere: a store shared by every
engine (the host tier, a directory, Redis), and another engine's cache (prefill/decode
disaggregation). The engine core calls a connector explicitly, at fixed points of the step; the
scheduler and the KV manager never call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from deepinfer.engine.outputs import KVHandoff
from deepinfer.sequence import Sequence


class KVConnector(Protocol):
    def prefetch(self, seq: Sequence) -> None:
        """A request arrived: start bringing in what is held elsewhere beyond the device's prefix
        hits. May add to `seq.num_pending` (the scheduler admits it only at 0)."""
        ...

    def poll(self) -> dict[str, str]:
        """Before scheduling (and while the engine idles, if `busy`): install every finished load
        into free device blocks (indexed in the prefix cache, so admission sees ordinary hits),
        release its sequence's wait, and give back blocks lent out that are no longer needed.
        Returns the requests whose KV could not come and that must fail, by policy
        (request_id -> why); the engine ends those, nothing else."""
        ...

    def save_completed(self, seqs: Iterable[Sequence]) -> dict[str, str]:
        """After the step's update: hand the newly completed, indexed blocks of `seqs` (finished
        ones included: their freed blocks are still indexed) to wherever they go. Returns the
        requests it failed for (request_id -> why); the engine ends those, nothing else."""
        ...

    def take_handoffs(self) -> list[KVHandoff]:
        """Prompts whose KV became ready for another engine since the last call (prefill role)."""
        ...

    @property
    def busy(self) -> bool:
        """Whether `poll` has work even when no sequence is scheduled (leases, pending writes)."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def close(self, timeout_s: float) -> None:
        """Flush what is queued, for at most `timeout_s`, and stop its threads."""
        ...


class ConnectorChain:
    """Several connectors as one, called in order (the store before a disaggregation connector,
    so a prefill engine's store writes are queued before its handoff waits on them)."""

    def __init__(self, connectors: list[KVConnector]) -> None:
        self.connectors = connectors

    def prefetch(self, seq: Sequence) -> None:
        for connector in self.connectors:
            connector.prefetch(seq)

    def poll(self) -> dict[str, str]:
        failures: dict[str, str] = {}
        for connector in self.connectors:
            failures.update(connector.poll())
        return failures

    def save_completed(self, seqs: Iterable[Sequence]) -> dict[str, str]:
        seqs = list(seqs)
        failures: dict[str, str] = {}
        for connector in self.connectors:
            failures.update(connector.save_completed(seqs))
        return failures

    def take_handoffs(self) -> list[KVHandoff]:
        return [handoff for connector in self.connectors for handoff in connector.take_handoffs()]

    @property
    def busy(self) -> bool:
        return any(connector.busy for connector in self.connectors)

    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for connector in self.connectors:
            merged.update(connector.metrics())
        return merged

    def close(self, timeout_s: float) -> None:
        for connector in self.connectors:
            connector.close(timeout_s)
