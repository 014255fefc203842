"""What every rank of a multi-rank engine knows about the others: its topology, the collectives,
and (rank 0 of a tensor-parallel group) the channel its forwards go out on."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.distributed.comm import Collectives
from deepinfer.distributed.topology import Topology
from deepinfer.engine.parallel.cores import usable_cpus
from deepinfer.model.parallel import ExpertParallel, ModelParallel, TensorParallel
from deepinfer.runner.model_runner import Peers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankContext:
    config: EngineConfig
    topology: Topology
    comm: Collectives
    peers: Peers | None = None  # rank 0 of a tensor-parallel group: the other ranks
    rank_pids: list[int] = field(default_factory=list)  # rank 0: the ranks it spawned on this machine
    # Called when the engine closes (rank 0: stop the other ranks, free the channel and the group).
    on_close: list[Any] = field(default_factory=list)

    @property
    def lockstep(self) -> bool:
        """Data-parallel ranks meet in the MoE layers' all-to-alls: every rank runs a forward in
        every step, an empty one without work."""
        return self.topology.dp_size > 1 and self.topology.expert_parallel

    def model_parallel(self) -> ModelParallel:
        topo, parallel = self.topology, self.config.parallel
        tp = TensorParallel(topo.tp_rank, topo.tp_size, self.comm if topo.tp_size > 1 else None)
        ep = None
        if topo.expert_parallel:
            ep = ExpertParallel(
                topo.rank,
                topo.world_size,
                self.comm,
                tp,
                num_redundant_experts=parallel.num_redundant_experts,
                record_load=parallel.enable_eplb,
            )
        return ModelParallel(tp, ep)

    def close(self) -> None:
        while self.on_close:
            self.on_close.pop()()


def rank_threads(config: EngineConfig, topology: Topology | None) -> int:
    """Torch threads of this rank: --num-threads, else the CPUs this process may use (its affinity,
    its cgroup's quota: cores.py) split over the machine's ranks."""
    cpus = usable_cpus()
    if config.num_threads:
        if config.num_threads > cpus:
            log.warning(
                "--num-threads %d is more than the %d CPUs this process may use (affinity, cgroup quota): "
                "its threads will wait on each other",
                config.num_threads,
                cpus,
            )
        return config.num_threads
    if topology is None or not topology.is_distributed:
        return cpus
    return max(cpus // topology.ranks_per_node, 1)


def bind_cores(config: EngineConfig, topology: Topology) -> list[int] | None:
    """--cpu-binding: pin this process to its share of the machine's cores."""
    if not config.parallel.cpu_binding or not hasattr(os, "sched_setaffinity"):
        return None
    share = topology.cpu_share(sorted(os.sched_getaffinity(0)), config.num_threads)
    os.sched_setaffinity(0, share)
    return share
