"""What each rank runs in the expert-parallel tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from deepinfer.distributed.comm import Collectives
from deepinfer.model.layers.expert_parallel import ExpertParallelExperts
from deepinfer.model.layers.moe import RoutedExperts
from deepinfer.model.parallel import SINGLE, ExpertParallel

E, HIDDEN, INTER, TOP_K = 8, 16, 12, 3
TOKENS = (7, 0, 13)  # tokens of each step on rank 0; rank 1 has the reverse, so one rank may have none


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, HIDDEN, generator=g), torch.randn(E, HIDDEN, INTER, generator=g)


def routing(step: int, rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, weights, ids of one rank's tokens; experts 6 and 7 never get any."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = (
        torch.stack([torch.randperm(6, generator=g)[:TOP_K] for _ in range(tokens)])
        if tokens
        else torch.zeros(0, TOP_K, dtype=torch.long)
    )
    return x, torch.rand(tokens, TOP_K, generator=g), ids


def tokens_of(rank: int, step: int) -> int:
    return TOKENS[step] if rank == 0 else TOKENS[len(TOKENS) - 1 - step]


def reference(world: int) -> list[torch.Tensor]:
    """The single-process layer over every rank's tokens, concatenated in rank order (one
    thread, like the ranks: a GEMM's rounding may depend on how it is split over threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    w13, w2 = weights()
    layer = RoutedExperts(E, HIDDEN, INTER)
    layer.w13.data, layer.w2.data = w13, w2
    outs = []
    try:
        for step in range(len(TOKENS)):
            parts = [routing(step, r, tokens_of(r, step)) for r in range(world)]
            outs.append(layer(*(torch.cat([p[i] for p in parts]) for i in range(3))))
    finally:
        torch.set_num_threads(threads)
    return outs


def ep_layer(rank: int, comm: Collectives, redundant: int, record: bool = False) -> ExpertParallelExperts:
    ep = ExpertParallel(rank, comm.size, comm, SINGLE, num_redundant_experts=redundant, record_load=record)
    layer = ExpertParallelExperts(E, HIDDEN, INTER, ep)
    w13, w2 = weights()
    layer.w13.data = torch.stack(
        [w13[layer.physical_to_logical[rank * layer.slots + s]] for s in range(layer.slots)]
    )
    layer.w2.data = torch.stack(
        [w2[layer.physical_to_logical[rank * layer.slots + s]] for s in range(layer.slots)]
    )
    return layer


def dispatch_combine(rank: int, comm: Collectives, redundant: int) -> list[torch.Tensor]:
    """This rank's outputs of every step, through the all-to-all dispatch and combine."""
    layer = ep_layer(rank, comm, redundant)
    return [layer(*routing(step, rank, tokens_of(rank, step))) for step in range(len(TOKENS))]


def moved(rank: int, comm: Collectives) -> tuple[list[torch.Tensor], list[int], int]:
    """Record load, re-place with 2 redundant experts (moving weights between ranks), run again."""
    from deepinfer.model.layers.expert_parallel import ExpertBalancer

    layer = ep_layer(rank, comm, redundant=2, record=True)
    for step in range(len(TOKENS)):
        layer(*routing(step, rank, tokens_of(rank, step)))
    balancer = ExpertBalancer([layer], layer.ep, interval=1000, policy="global")
    balancer.rebalance()
    outs = [layer(*routing(step, rank, tokens_of(rank, step))) for step in range(len(TOKENS))]
    return outs, layer.physical_to_logical.tolist(), balancer.num_rebalances


def every_case(rank: int, comm: Collectives) -> dict[str, object]:
    """All of the above on one pair of ranks (starting ranks is the slow part)."""
    return {
        "exact": dispatch_combine(rank, comm, 0),
        "replicas": dispatch_combine(rank, comm, 2),
        "moved": moved(rank, comm),
    }
