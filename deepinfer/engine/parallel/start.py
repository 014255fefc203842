"""Rank 0 starts an engine over several ranks: spawn this machine's other ranks, join the group,
open the step channel, and build the engine core (the tensor-parallel group's rank 0, or the
data-parallel engine in front of every rank's core)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import threading
from collections.abc import Callable

from deepinfer.config import EngineConfig
from deepinfer.distributed.comm import Collectives
from deepinfer.distributed.topology import Topology, resolve_topology
from deepinfer.engine.build import build_engine_core
from deepinfer.engine.core import EngineCore
from deepinfer.engine.parallel.channel import PeerLost, ProcessGroupChannel, ShmChannel, StepChannel
from deepinfer.engine.parallel.context import RankContext, bind_cores
from deepinfer.engine.parallel.data_parallel import DataParallelEngine
from deepinfer.engine.parallel.launch import LocalRanks, PeerMonitor, RankWatchdog
from deepinfer.engine.parallel.messages import Shutdown
from deepinfer.engine.parallel.worker import TensorParallelPeers, distributed_backend, rank_main
from deepinfer.model.loader.load import LoadedModel, check_model_parallel

log = logging.getLogger(__name__)

OnRankDeath = Callable[[str], None]


def _log_death(reason: str) -> None:
    log.error("%s: the engine's next step fails", reason)


def _connect(config: EngineConfig, topology: Topology, local: LocalRanks | None) -> Collectives:
    """Join the group, giving up as soon as a local rank dies instead of waiting out the timeout."""
    result: list[Collectives | BaseException] = []

    def connect() -> None:
        try:
            result.append(
                Collectives.connect(
                    topology, distributed_backend(config), config.parallel.distributed_timeout
                )
            )
        except BaseException as error:
            result.append(error)

    thread = threading.Thread(target=connect, name="deepinfer-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        if local is not None and multiprocessing.connection.wait(local.sentinels, timeout=0.2):
            raise PeerLost(f"{local.first_exit()} before joining the engine's group")
        thread.join(0 if local is not None else 0.2)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def start_engine(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    on_rank_death: OnRankDeath | None = None,
    log_level: str = "info",
) -> EngineCore | DataParallelEngine:
    """The engine of `config`: one core in this process, or rank 0 of several ranks.
    `on_rank_death` is called (from a watchdog thread) when another rank is gone."""
    if config.parallel.world_size == 1:
        return build_engine_core(config, loaded)
    topology = resolve_topology(config.parallel)
    if topology.rank != 0:
        raise ValueError(
            f"this process is rank {topology.rank}: only rank 0 runs the engine's scheduler "
            "(`deepinfer serve` with the same options serves as rank N)"
        )
    check_model_parallel(config.model, config.parallel)  # before any other rank starts
    bind_cores(config, topology)
    on_death = on_rank_death or _log_death
    closers: list[Callable[[], None]] = []

    def close_all() -> None:
        while closers:
            try:
                closers.pop()()
            except Exception:
                log.exception("while stopping the ranks")

    try:
        channel: StepChannel | None = None
        if topology.local_channel:
            channel = ShmChannel(topology.world_size - 1)
            closers.append(channel.close)
        local = None
        if not topology.external_launch and topology.ranks_per_node > 1:
            handles = (
                channel.handles if isinstance(channel, ShmChannel) else [None] * (topology.ranks_per_node - 1)
            )
            local = LocalRanks(rank_main, config, topology, list(topology.node_ranks)[1:], handles, log_level)
            closers.append(local.stop)
            if isinstance(channel, ShmChannel):
                channel.sentinels = local.sentinels
        comm = _connect(config, topology, local)
        closers.append(comm.close)
        if channel is None:
            channel = ProcessGroupChannel(comm.store, topology)
        channel_ref = channel
        closers.append(lambda: channel_ref.publish(Shutdown()))
        if local is not None:
            watchdog = RankWatchdog(local, on_death)
            closers.append(watchdog.stop)
        if not topology.local_channel:
            monitor = PeerMonitor(comm.store, topology, config.parallel.distributed_timeout, on_death)
            closers.append(monitor.stop)
        context = RankContext(config, topology, comm, on_close=[close_all])
        atexit.register(close_all)  # a script that never closes its LLM still stops its ranks
        context.rank_pids = local.pids if local is not None else []
        if topology.dp_size > 1:
            return DataParallelEngine(build_engine_core(config, parallel=context), channel)
        context.peers = TensorParallelPeers(channel)
        return build_engine_core(config, parallel=context)
    except BaseException:
        close_all()
        raise
