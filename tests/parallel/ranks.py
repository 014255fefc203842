"""Run a function on N real processes joined in one gloo group (the engine's Collectives), and
collect what each returns. The function must be importable (module level) for spawn."""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from deepinfer.distributed.topology import Topology, free_port


def _rank(fn: Callable[..., Any], topology: Topology, args: tuple, results: Any) -> None:
    import torch

    from deepinfer.distributed.comm import Collectives

    torch.set_num_threads(1)
    try:
        comm = Collectives.connect(topology, "gloo", 60.0)
        # Pickled here: a tensor put on the queue as is travels as a shared-memory handle, which
        # is gone once this process exits before the parent reads it.
        results.put((topology.rank, "ok", pickle.dumps(fn(topology.rank, comm, *args))))
    except BaseException:
        results.put((topology.rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    topology = Topology(
        tp_size=world,
        dp_size=1,
        expert_parallel=True,
        nnodes=1,
        node_rank=0,
        rank=0,
        master_addr="127.0.0.1",
        master_port=free_port(),
    )
    processes = [
        context.Process(target=_rank, args=(fn, topology.for_rank(r), args, results), daemon=True)
        for r in range(world)
    ]
    for process in processes:
        process.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout_s)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(10)
            if process.exitcode is None:
                process.kill()
    return [out[r] for r in range(world)]
