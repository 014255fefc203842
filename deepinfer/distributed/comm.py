"""The collectives of one engine's ranks, over a torch.distributed process group (gloo on the
CPU, NCCL on CUDA), with what they cost counted.

The group is built from its own TCPStore rather than torch.distributed's global default group:
several engines can live in one Python process (tests, a driver script), and closing one frees
its group. Rank 0 hosts the store at master_addr:master_port; the others connect to it.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepinfer.distributed.topology import Topology


@dataclass(slots=True)
class CommStats:
    """Collective calls, bytes this rank sent into them, and seconds spent in them."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    by_op: dict[str, list[float]] = field(default_factory=dict)  # op -> [calls, bytes, seconds]

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds
        entry = self.by_op.setdefault(op, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += seconds

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0
        self.by_op.clear()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Collectives:
    """Collectives over every rank of the engine (`group` spans ranks 0..size-1)."""

    def __init__(
        self, group: dist.ProcessGroup, rank: int, size: int, store: dist.Store | None = None
    ) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.stats = CommStats()
        self._store = store  # on rank 0, the store server: it lives as long as the group

    @classmethod
    def connect(cls, topology: Topology, backend: str, timeout_s: float, name: str = "engine") -> Collectives:
        """Join the group of every rank (blocks until all have joined, or `timeout_s`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            topology.master_addr,
            topology.master_port,
            topology.world_size,
            is_master=topology.rank == 0 and not topology.launcher_store,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(name, store)
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(prefixed, topology.rank, topology.world_size)
        else:
            group = dist.ProcessGroupGloo(prefixed, topology.rank, topology.world_size, timeout)
        return cls(group, topology.rank, topology.world_size, store)

    @property
    def store(self) -> dist.Store:
        """The rendezvous store, for the other groups of the engine (step channel, monitor)."""
        assert self._store is not None
        return self._store

    def _timed(self, op: str, nbytes: int, work: dist.Work) -> None:
        began = time.perf_counter()
        work.wait()
        self.stats.add(op, nbytes, time.perf_counter() - began)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        began = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self.stats.add("all_reduce", _nbytes(tensor), time.perf_counter() - began)
        return tensor

    def all_reduce_min(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._timed("all_reduce", 8, self.group.allreduce([tensor], opts))
        return int(tensor.item())

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all of one shape), in rank order."""
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]]
        self._timed("all_gather", _nbytes(tensor), self.group.allgather(outputs, [tensor.contiguous()]))
        return outputs[0]

    def all_to_all(
        self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows [sum(send_counts), ...] in rank order, send_counts[r] of them to rank r; returns the
        rows received, recv_counts[r] from rank r, in rank order."""
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        work = self.group.alltoall_base(out, tensor.contiguous(), recv_counts, send_counts)
        self._timed("all_to_all", _nbytes(tensor), work)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts [size] int64 (rows this rank sends to each) -> rows each rank sends here."""
        out = torch.empty_like(send_counts)
        ones = [1] * self.size
        self._timed(
            "all_to_all", _nbytes(send_counts), self.group.alltoall_base(out, send_counts, ones, ones)
        )
        return out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._timed("broadcast", _nbytes(tensor), self.group.broadcast(tensor, root))
        return tensor

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def close(self) -> None:
        """Drop the group and (on rank 0) the store server."""
        self.group = None  # type: ignore[assignment]
        self._store = None
