"""Where every rank of an engine sits: its node, its tensor- and data-parallel coordinates, and
how the ranks were started. Torch-free; built from the validated ParallelConfig and, for ranks a
launcher started (torchrun, Slurm, Kubernetes), the usual environment variables.

Ranks are numbered node by node: node n holds ranks n * ranks_per_node .. (n + 1) * ranks_per_node
- 1, and rank r is data-parallel rank r // tp and tensor-parallel rank r % tp. Rank 0 runs the
scheduler (of the engine, or of data-parallel rank 0 and the balancer over all of them).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from deepinfer.config import ParallelConfig

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclass(frozen=True, slots=True)
class Topology:
    tp_size: int
    dp_size: int
    expert_parallel: bool
    nnodes: int
    node_rank: int
    rank: int  # this process's rank
    master_addr: str
    master_port: int
    # A launcher started every rank (RANK / WORLD_SIZE in the environment): no rank spawns others.
    external_launch: bool = False
    # torchrun's agent already serves the rendezvous store at master_addr:master_port: rank 0
    # connects to it instead of hosting one.
    launcher_store: bool = False

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node_ranks(self) -> range:
        """The ranks of this rank's node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def local_channel(self) -> bool:
        """Step plans can go through shared memory: every rank is a child of rank 0's process."""
        return self.nnodes == 1 and not self.external_launch

    def for_rank(self, rank: int) -> Topology:
        return dataclasses.replace(self, rank=rank, node_rank=rank // self.ranks_per_node)

    def cpu_share(self, cores: list[int], threads: int | None) -> list[int]:
        """The cores this rank binds to: its consecutive share of the node's cores."""
        per_rank = threads or max(len(cores) // self.ranks_per_node, 1)
        start = (self.local_rank * per_rank) % max(len(cores), 1)
        return cores[start : start + per_rank] or cores


def _env_int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if environ.get(name):
            try:
                return int(environ[name])
            except ValueError:
                raise ValueError(f"${name}={environ[name]!r} is not an integer") from None
    return None


_given_ports: set[int] = set()
_given_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never returned before by this process. The OS may give the
    same free port to two asks before either is bound: several servers started together (the
    gateway tests' listening and metrics ports) then collided."""
    with _given_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _given_ports:
                _given_ports.add(port)
                return port


def resolve_topology(parallel: ParallelConfig, environ: Mapping[str, str] | None = None) -> Topology:
    """This process's place: rank 0 of its node when `deepinfer` starts the node's ranks itself,
    or the rank a launcher gave it. Options given on the command line win over the environment."""
    env = os.environ if environ is None else environ
    env_rank, env_world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    external = env_rank is not None and env_world is not None and env_world > 1
    if external and env_world != parallel.world_size:
        raise ValueError(
            f"$WORLD_SIZE={env_world} but tensor_parallel_size x data_parallel_size = {parallel.world_size}"
        )
    nnodes = parallel.nnodes
    if external and nnodes == 1:
        nnodes = _env_int(env, "NNODES") or max(
            parallel.world_size // (_env_int(env, "LOCAL_WORLD_SIZE") or parallel.world_size), 1
        )
    node_rank = parallel.node_rank
    if node_rank is None:
        node_rank = _env_int(env, "NODE_RANK", "GROUP_RANK") or 0
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
    ranks_per_node = parallel.world_size // nnodes
    rank = env_rank if external else node_rank * ranks_per_node
    master_addr = parallel.master_addr or env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
    master_port = parallel.master_port or _env_int(env, "MASTER_PORT")
    if master_port is None:
        # One machine started by us: any free port (the children learn it from their arguments).
        master_port = free_port() if nnodes == 1 and not external else DEFAULT_MASTER_PORT
    return Topology(
        tp_size=parallel.tensor_parallel_size,
        dp_size=parallel.data_parallel_size,
        expert_parallel=parallel.enable_expert_parallel,
        nnodes=nnodes,
        node_rank=rank // ranks_per_node,
        rank=rank,
        master_addr=master_addr,
        master_port=master_port,
        external_launch=external,
        launcher_store=external and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
