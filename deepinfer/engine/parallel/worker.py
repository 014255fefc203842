"""The ranks other than 0: their entry point, their loops, and the supervisor of a machine's
ranks on a node other than 0.

A tensor-parallel rank holds its shard of the model and its share of every KV cache, and runs
each ForwardWork rank 0 sends it (rank 0 samples; the logits all-gather gave everyone the same
vocabulary). A data-parallel rank runs a whole engine core (data_parallel.DataParallelRank).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import time

import torch

from deepinfer.config import EngineConfig
from deepinfer.distributed.comm import Collectives
from deepinfer.distributed.topology import Topology, resolve_topology
from deepinfer.engine.build import (
    build_engine_core,
    build_expert_balancer,
    config_on_device,
    engine_device,
    kv_cache_dtype,
    plan_engine_caches,
)
from deepinfer.engine.parallel.channel import (
    PeerLost,
    ProcessGroupChannel,
    ShmHandle,
    ShmWorkerEnd,
    StepChannel,
    WorkerEnd,
)
from deepinfer.engine.parallel.context import RankContext, bind_cores, rank_threads
from deepinfer.engine.parallel.data_parallel import DataParallelRank
from deepinfer.engine.parallel.launch import LocalRanks, PeerMonitor, die_with_parent
from deepinfer.engine.parallel.messages import Shutdown
from deepinfer.model.loader.dtype import engine_dtype
from deepinfer.model.loader.load import load_model
from deepinfer.runner.inputs import ForwardWork
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


def distributed_backend(config: EngineConfig) -> str:
    backend = config.parallel.distributed_backend
    if backend != "auto":
        return backend
    return "nccl" if engine_device(config, None).type == "cuda" else "gloo"


class TensorParallelPeers:
    """Rank 0's view of the other ranks of its tensor-parallel group."""

    def __init__(self, channel: StepChannel) -> None:
        self.channel = channel

    def submit(self, work: ForwardWork) -> None:
        self.channel.publish(work)


def build_tensor_parallel_runner(config: EngineConfig, context: RankContext) -> ModelRunner:
    """This rank's shard, its share of the caches (the block count rank 0's scheduler plans
    with), and a runner without sampling state."""
    torch.set_num_threads(rank_threads(config, context.topology))
    device = engine_device(config, context)
    config = config_on_device(config, device)  # the caches rank 0 plans, so the same budget
    dtype = engine_dtype(config, device)
    loaded = load_model(
        config.model, dtype, device, config.quantization, context.model_parallel(), config.rope_scaling
    )
    model = loaded.model
    declared = {"target": model.cache_groups(kv_cache_dtype(config, loaded, dtype, device))}
    layout = plan_engine_caches(config, declared["target"], device, context)
    caches = KVCaches(layout, declared, device)
    return ModelRunner(
        model, caches, device, config.attention_backend, experts=build_expert_balancer(config, model, context)
    )


def run_tensor_parallel_rank(runner: ModelRunner, end: WorkerEnd) -> None:
    while True:
        work = end.receive()
        if isinstance(work, Shutdown):
            return
        runner.run(work)


def _exit_soon(reason: str) -> None:
    """Another rank is gone: leave, unless a Shutdown being handled ends this rank first."""
    time.sleep(2.0)
    log.error("%s: this rank stops", reason)
    os._exit(1)


def serve_rank(
    config: EngineConfig, topology: Topology, handle: ShmHandle | None = None, parent_pid: int | None = None
) -> None:
    """Join the engine's group and serve rank 0's messages until told to stop."""
    cores = bind_cores(config, topology)
    comm = Collectives.connect(topology, distributed_backend(config), config.parallel.distributed_timeout)
    if handle is not None:
        assert parent_pid is not None
        end: WorkerEnd = ShmWorkerEnd(handle, parent_pid)
        monitor = None
    else:
        end = ProcessGroupChannel(comm.store, topology)
        monitor = PeerMonitor(comm.store, topology, config.parallel.distributed_timeout, _exit_soon)
    log.info(
        "rank %d of %d ready to load (tp rank %d, dp rank %d%s)",
        topology.rank,
        topology.world_size,
        topology.tp_rank,
        topology.dp_rank,
        f", cores {cores}" if cores else "",
    )
    context = RankContext(config, topology, comm)
    try:
        if topology.dp_size > 1:
            core = build_engine_core(config, parallel=context)
            try:
                DataParallelRank(core, end).run()
            finally:
                core.close()
        else:
            run_tensor_parallel_rank(build_tensor_parallel_runner(config, context), end)
    finally:
        if monitor is not None:
            monitor.stop()
        end.close()
        comm.close()


def rank_main(
    config: EngineConfig, topology: Topology, handle: ShmHandle | None, parent_pid: int, log_level: str
) -> None:
    """Entry point of a spawned rank."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s rank {topology.rank} %(levelname)s %(message)s"
    )
    try:
        serve_rank(config, topology, handle, parent_pid)
    except PeerLost as error:
        log.error("%s: rank %d stops", error, topology.rank)
        raise SystemExit(1) from error
    except Exception:
        log.exception("rank %d failed", topology.rank)
        raise SystemExit(1) from None


def run_node(config: EngineConfig, log_level: str = "info") -> int:
    """`deepinfer serve` on a rank other than 0: a launcher's rank runs here; on node N > 0 this
    process starts the machine's ranks and waits on them (SIGTERM / SIGINT stop them all)."""
    topology = resolve_topology(config.parallel)
    if topology.external_launch:
        rank_main(config, topology, None, os.getppid(), log_level)
        return 0
    ranks = LocalRanks(
        rank_main, config, topology, list(topology.node_ranks), [None] * topology.ranks_per_node, log_level
    )
    print(
        f"DeepInfer node {topology.node_rank} of {topology.nnodes}: ranks {list(topology.node_ranks)} "
        f"(pids {ranks.pids}), rendezvous at {topology.master_addr}:{topology.master_port}",
        flush=True,
    )

    signalled = []

    def stop(signum: int, _frame: object) -> None:
        signalled.append(signum)
        for process in ranks.processes.values():
            if process.exitcode is None:
                process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    multiprocessing.connection.wait(ranks.sentinels)
    first = ranks.first_exit()
    for process in ranks.processes.values():  # one rank gone: the engine is; stop the others
        if process.exitcode is None:
            process.terminate()
    ranks.stop(grace_s=5.0)
    if signalled:
        return 0
    failed = any(p.exitcode for p in ranks.processes.values())
    (log.error if failed else log.info)("node %d stops: %s", topology.node_rank, first)
    return 1 if failed else 0
