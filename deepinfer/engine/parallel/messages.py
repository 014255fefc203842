"""What rank 0 sends the other ranks, and what data-parallel ranks answer (plain data, pickled
onto the step channel). Tensor-parallel ranks get a runner.inputs.ForwardWork per forward."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.outputs import SequenceOutput
from deepinfer.engine.stats import EngineStats
from deepinfer.sequence import EngineRequest


@dataclass(slots=True)
class Shutdown:
    """Stop: the rank leaves its loop, frees its resources and exits."""


@dataclass(slots=True)
class DataParallelStep:
    """One lockstep iteration of the data-parallel ranks. Each rank takes the requests and aborts
    addressed to it, then steps if `step` (every rank, so that the MoE layers' all-to-alls meet)."""

    adds: list[tuple[int, EngineRequest]] = field(default_factory=list)  # (rank, request)
    aborts: list[tuple[int, str, int | None]] = field(default_factory=list)  # (rank, request id, index)
    step: bool = False
    idle_forward: bool = False  # rank 0 runs a forward of its own (scoring): the others run an empty one
    reset_prefix_cache: bool = False


@dataclass(slots=True)
class DataParallelReply:
    outputs: list[SequenceOutput]
    stats: EngineStats
    has_work: bool
    prefix_cache_reset: bool | None = None
