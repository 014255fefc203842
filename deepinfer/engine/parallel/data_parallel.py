"""Attention data parallelism: every rank is a whole engine core (its own scheduler, requests and
KV cache) over its shard of the experts, and the ranks step together, because the MoE layers'
all-to-alls need all of them. Rank 0's DataParallelEngine fronts them with the interface of one
engine (protocol.Engine, what EngineLoop and LLMEngine drive): it routes each new request to a rank
(balancer.py), sends every rank its requests and aborts with the step, steps its own core, and
gathers the others' outputs and stats (one set per rank, for the metrics).
"""

from __future__ import annotations

import logging

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.core import EngineCore
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.outputs import KVHandoff, SequenceOutput
from deepinfer.engine.parallel.balancer import DataParallelBalancer
from deepinfer.engine.parallel.channel import StepChannel, WorkerEnd
from deepinfer.engine.parallel.messages import DataParallelReply, DataParallelStep, Shutdown
from deepinfer.engine.stats import EngineStats
from deepinfer.model.loader.load import LoadedModel
from deepinfer.sequence import EngineRequest
from deepinfer.structured import GrammarSpec
from deepinfer.transport.kv_event_log import KVEvent

log = logging.getLogger(__name__)


def summed(per_rank: list[EngineStats]) -> EngineStats:
    fields = [f for f in EngineStats.__dataclass_fields__ if f != "per_rank"]
    total = EngineStats(**{f: sum(getattr(s, f) for s in per_rank) for f in fields})
    total.per_rank = per_rank
    return total


class DataParallelEngine:
    """Rank 0's front of the data-parallel ranks (a protocol.Engine). Mutates: the local core
    (its requests), the pending message for the other ranks, the owner of every unfinished
    request."""

    def __init__(self, core: EngineCore, channel: StepChannel) -> None:
        self.core = core
        self.channel = channel
        self.num_ranks = core.parallel.topology.dp_size if core.parallel else 1
        self.balancer = DataParallelBalancer(self.num_ranks, core.config.cache.block_size, core.num_blocks)
        self.pending = DataParallelStep()
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (rank, sequences unfinished)
        self.remote_work = [False] * self.num_ranks
        self.rank_stats: list[EngineStats] = [core.stats()] * self.num_ranks
        self.failed: str | None = None  # set when a lockstep iteration failed half way
        self._closed = False

    # -- what EngineLoop, LLMEngine and engine_info read of an engine (rank 0's) -----------------

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def loaded(self) -> LoadedModel:
        return self.core.loaded

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def fingerprint(self) -> str:
        return self.core.fingerprint

    @property
    def num_blocks(self) -> int:
        """One rank's blocks (every rank plans the same cache)."""
        return self.core.num_blocks

    @property
    def num_unfinished_requests(self) -> int:
        """Requests routed to any rank and not finished."""
        return len(self.owner)

    def validate_grammar(self, spec: GrammarSpec) -> None:
        self.core.validate_grammar(spec)

    # Roles, KV events and the store are refused over several ranks (EngineConfig), so there is
    # no transfer listener, no connector to poll and nothing to hand off or publish.
    kv_transfer_address: str | None = None
    kv_transfer_layout: str | None = None
    connector_busy = False

    def housekeeping(self) -> list[SequenceOutput]:
        return []

    def take_handoffs(self) -> list[KVHandoff]:
        return []

    def take_kv_events(self) -> list[KVEvent]:
        return []

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        root = namespace_root(self.core.fingerprint, request.cache_salt)
        rank = self.balancer.choose(request.prompt_token_ids, root, request.params.n)
        self.owner[request.request_id] = (rank, request.params.n)
        if rank == 0:
            self.core.add_request(request)
        else:
            self.pending.adds.append((rank, request))

    def abort(self, request_id: str, index: int | None = None) -> list[SequenceOutput]:
        owner = self.owner.get(request_id)
        if owner is None:
            return []
        rank, _ = owner
        if index is None:
            del self.owner[request_id]
        if rank == 0:
            return self.core.abort(request_id, index)
        self.pending.aborts.append((rank, request_id, index))
        return []

    def has_work(self) -> bool:
        pending = self.pending
        return bool(self.core.has_work() or any(self.remote_work) or pending.adds or pending.aborts)

    def reset_prefix_cache(self) -> bool:
        self.pending.reset_prefix_cache = True
        _, replies = self._exchange()
        self.balancer.forget()
        local = self.core.reset_prefix_cache()
        return local and all(bool(r.prefix_cache_reset) for r in replies)

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        self.pending.step = True
        outputs, replies = self._exchange()
        for reply in replies:
            outputs.extend(reply.outputs)
        for out in outputs:
            self._finished(out)
        return outputs

    def _exchange(self) -> tuple[list[SequenceOutput], list[DataParallelReply]]:
        """Send the pending message, step locally (when it says so) while the others do, gather
        their replies: (this rank's outputs, the others' replies)."""
        if self.failed is not None:
            raise RuntimeError(
                f"the data-parallel ranks are out of step since an earlier failure: {self.failed}"
            )
        message, self.pending = self.pending, DataParallelStep()
        try:
            self.channel.publish(message)
            outputs = self.core.step() if message.step else []
            replies = self.channel.collect()
        except Exception as error:
            self.failed = f"{type(error).__name__}: {error}"
            raise
        self.rank_stats = [self.core.stats(), *(r.stats for r in replies)]
        self.remote_work = [False, *(r.has_work for r in replies)]
        for rank, stats in enumerate(self.rank_stats):
            self.balancer.report(rank, stats.num_running + stats.num_waiting)
        return outputs, replies

    def _finished(self, out: SequenceOutput) -> None:
        if out.finish_reason is None:
            return
        owner = self.owner.get(out.request_id)
        if owner is None:
            return
        rank, unfinished = owner
        if unfinished <= 1:
            del self.owner[out.request_id]
        else:
            self.owner[out.request_id] = (rank, unfinished - 1)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of a prompt on rank 0, the other ranks stepping through the MoE layers with it."""
        self.pending.idle_forward = True
        message, self.pending = self.pending, DataParallelStep()
        self.channel.publish(message)
        try:
            return self.core.score(token_ids)
        finally:
            self.channel.collect()

    def stats(self) -> EngineStats:
        return summed(self.rank_stats)

    def spec_stats(self) -> None:
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.core.close(timeout_s)  # publishes Shutdown through the rank context's close hooks


class DataParallelRank:
    """A data-parallel rank other than 0: its core, driven by rank 0's messages."""

    def __init__(self, core: EngineCore, end: WorkerEnd) -> None:
        self.core = core
        self.end = end

    def run(self) -> None:
        core = self.core
        rank = core.parallel.topology.dp_rank if core.parallel else 0
        while True:
            message = self.end.receive()
            if isinstance(message, Shutdown):
                return
            outputs: list[SequenceOutput] = []
            for target, request in message.adds:
                if target == rank:
                    core.add_request(request)
            for target, request_id, index in message.aborts:
                if target == rank:
                    core.abort(request_id, index)
            reset = core.reset_prefix_cache() if message.reset_prefix_cache else None
            if message.idle_forward:
                core.idle_forward()
            elif message.step:
                outputs = core.step()
            self.end.reply(DataParallelReply(outputs, core.stats(), core.has_work(), reset))
