"""Starting the ranks of one machine, and noticing when one is gone.

Rank 0 (the engine process of `deepinfer serve`, or an `LLM` in a script) spawns the other ranks
of its machine; on another machine `deepinfer serve --node-rank N` spawns that machine's ranks
and waits on them. Spawned ranks die with the process that spawned them (PR_SET_PDEATHSIG, and
a check of the parent's pid while idle), so no rank outlives its engine.

Death of a rank is noticed within a second, without any step running: on one machine through
the process sentinels (RankWatchdog), across machines by a heartbeat all-reduce on a group of
its own (PeerMonitor).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from deepinfer.config import EngineConfig
from deepinfer.distributed.topology import Topology
from deepinfer.engine.parallel.channel import ShmHandle

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that spawned it exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        log.debug("prctl unavailable: this rank relies on its parent-pid check")


RankMain = Callable[[EngineConfig, Topology, ShmHandle | None, int, str], None]


class LocalRanks:
    """Ranks of this machine spawned by this process (one process each), each running `rank_main`
    (the worker's entry point, passed in so that this module never imports the worker)."""

    def __init__(
        self,
        rank_main: RankMain,
        config: EngineConfig,
        topology: Topology,
        ranks: list[int],
        handles: list[ShmHandle | None],
        log_level: str,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        for rank, handle in zip(ranks, handles):
            process = context.Process(
                target=rank_main,
                args=(config, topology.for_rank(rank), handle, os.getpid(), log_level),
                name=f"deepinfer-rank-{rank}",
                daemon=True,
            )
            process.start()
            self.processes[rank] = process

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.processes.values()]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.pid is not None]

    def first_exit(self) -> str | None:
        for process in self.processes.values():
            if process.sentinel in multiprocessing.connection.wait(self.sentinels, timeout=0):
                process.join(1.0)  # the sentinel closes a moment before the exit code is there
        for rank, process in self.processes.items():
            if process.exitcode is not None:
                return f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        """Join the ranks (they were told to stop); terminate, then kill, stragglers."""
        for process in self.processes.values():
            process.join(grace_s)
        for process in self.processes.values():
            if process.exitcode is None:
                process.terminate()
                process.join(3.0)
            if process.exitcode is None:
                process.kill()
                process.join()


class RankWatchdog:
    """Calls `on_death(reason)` (from its own thread) as soon as a local rank exits."""

    def __init__(self, ranks: LocalRanks, on_death: Callable[[str], None]) -> None:
        self.ranks = ranks
        self.on_death = on_death
        self._stop_read, self._stop_write = os.pipe()
        self.thread = threading.Thread(target=self._watch, name="deepinfer-rank-watchdog", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([*self.ranks.sentinels, self._stop_read])
        if self._stop_read in ready:
            return
        reason = self.ranks.first_exit() or "a rank exited"
        log.error("%s: the engine fails", reason)
        self.on_death(reason)

    def stop(self) -> None:
        os.write(self._stop_write, b"x")
        self.thread.join(2.0)
        os.close(self._stop_read)
        os.close(self._stop_write)


class PeerMonitor:
    """A heartbeat all-reduce over every rank each second, on a gloo group of its own: a rank
    that is gone (or stuck past the timeout) makes it fail on every other rank."""

    def __init__(
        self, store: dist.Store, topology: Topology, timeout_s: float, on_lost: Callable[[str], None]
    ) -> None:
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("monitor", store),
            topology.rank,
            topology.world_size,
            datetime.timedelta(seconds=timeout_s),
        )
        self.on_lost = on_lost
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="deepinfer-peer-monitor", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        beat = torch.zeros(1)
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self.group.allreduce([beat]).wait()
            except RuntimeError as error:
                if not self.stopping.is_set():
                    log.error("a rank is gone: %s", error)
                    self.on_lost(f"a rank is gone: {error}")
                return

    def stop(self) -> None:
        self.stopping.set()
