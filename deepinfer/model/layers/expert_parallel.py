"""Expert parallelism for DeepSeekMoE: whole experts sharded over ranks, each (token, expert)
pair dispatched to a rank holding a replica of its expert by all-to-all and combined back by a
second one; and EPLB, which re-places the replicas by recorded load while the engine serves.

Rank r holds physical slots r * S .. (r + 1) * S - 1 (S = P / ranks), each a replica of one
logical expert (`physical_to_logical`). A pair goes to one replica of its expert (pairs spread
over an expert's replicas in turn). Its output comes back to the rank that sent it, which adds the
outputs of a token's pairs in expert order, as the single-process layer does: without redundant
replicas an expert multiplies exactly the rows, in the order, the single-process layer gives it,
so the result is bit-identical to it.

Every rank calls each MoE layer once per forward, with or without tokens: a rank without work
runs an empty step so that the others' all-to-alls complete.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer.distributed.eplb import Placement, balancedness, identity_placement, rebalance
from deepinfer.model.layers.mlp import swiglu
from deepinfer.model.parallel import ExpertParallel

log = logging.getLogger(__name__)


def run_experts(
    hidden: torch.Tensor,  # [P, hidden] rows grouped by expert
    counts: list[int],  # rows of each expert, in expert order
    w13: torch.Tensor,  # [E, 2I, hidden]
    w2: torch.Tensor,  # [E, hidden, I]
    swiglu_limit: float | None = None,
) -> torch.Tensor:  # [P, hidden]
    """Each expert's SwiGLU (clamped by `swiglu_limit` if given) over its rows, one matmul pair per
    expert with rows."""
    intermediate = w2.shape[2]
    out = torch.empty_like(hidden)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = F.linear(hidden[rows], w13[expert]).split(intermediate, dim=-1)
        out[rows] = F.linear(swiglu(gate, up, swiglu_limit), w2[expert])
        start += count
    return out


def combine_pairs(
    x: torch.Tensor, pair_out: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor, top_k: int
) -> torch.Tensor:
    """sum over each token's pairs of weight * output, added in `order` (pairs sorted by expert):
    pair_out [len(order), hidden] is in that order too."""
    weights = topk_weights.flatten()[order].unsqueeze(1)
    out = torch.zeros_like(x)
    out.index_add_(0, order // top_k, (pair_out * weights).to(x.dtype))
    return out


class ExpertParallelExperts(torch.nn.Module):
    """This rank's S physical experts of one layer: w13 [S, 2I, hidden], w2 [S, hidden, I];
    `swiglu_limit` clamps their activations (DeepSeek-V4)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        ep: ExpertParallel,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.ep = ep
        self.swiglu_limit = swiglu_limit
        self.num_logical = num_experts
        self.num_physical = num_experts + ep.num_redundant_experts
        if self.num_physical % ep.size:
            raise ValueError(
                f"{num_experts} experts + {ep.num_redundant_experts} redundant do not divide over {ep.size} "
                "expert-parallel ranks (set --num-redundant-experts so that they do)"
            )
        self.slots = self.num_physical // ep.size
        self.w13 = torch.nn.Parameter(
            torch.empty(self.slots, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = torch.nn.Parameter(
            torch.empty(self.slots, hidden_size, intermediate_size), requires_grad=False
        )
        # Tokens routed to each logical expert since the last rebalance (EPLB), on the weights' device.
        self.load: torch.Tensor | None = None
        self.place(identity_placement(1, num_experts, self.num_physical).physical_to_logical[0])

    def place(self, physical_to_logical: np.ndarray) -> None:
        """Adopt a placement (the weights must already be where it says)."""
        self.physical_to_logical = np.asarray(physical_to_logical, dtype=np.int64)
        counts = np.bincount(self.physical_to_logical, minlength=self.num_logical)
        replicas = np.full((self.num_logical, max(int(counts.max()), 1)), -1, dtype=np.int64)
        filled = np.zeros(self.num_logical, dtype=np.int64)
        for physical, logical in enumerate(self.physical_to_logical):
            replicas[logical, filled[logical]] = physical
            filled[logical] += 1
        self.replicas = torch.from_numpy(replicas)  # [E, max replicas] physical slots of each expert
        self.replica_counts = torch.from_numpy(counts)  # [E]

    def local_slots(self, logical: int) -> list[int]:
        """This rank's slots holding expert `logical` (where its checkpoint weights go)."""
        first = self.ep.rank * self.slots
        mine = self.physical_to_logical[first : first + self.slots]
        return [int(s) for s in np.flatnonzero(mine == logical)]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] of this rank, topk_* [T, k] (logical ids) -> [T, hidden]."""
        comm, top_k = self.ep.comm, topk_ids.shape[1]
        flat_ids = topk_ids.flatten()  # [T * k]; pair p belongs to token p // k
        if self.ep.record_load:
            counts = torch.bincount(flat_ids, minlength=self.num_logical)
            self.load = counts if self.load is None else self.load + counts
        pair = torch.arange(flat_ids.shape[0])
        physical = self.replicas[flat_ids, pair % self.replica_counts[flat_ids]]
        order = physical.argsort(stable=True)  # by destination rank, then slot
        send_counts = torch.bincount(physical // self.slots, minlength=self.ep.size)
        recv_counts = comm.exchange_counts(send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = comm.all_to_all(x[order // top_k], send, recv)  # [Q, hidden] pairs sent here
        slots = comm.all_to_all(physical[order] % self.slots, send, recv)  # [Q]
        by_slot = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=self.slots).tolist()
        computed = torch.empty_like(rows)
        computed[by_slot] = run_experts(rows[by_slot], counts, self.w13, self.w2, self.swiglu_limit)
        returned = comm.all_to_all(computed, recv, send)  # outputs of this rank's pairs, in `order`
        pair_out = torch.empty_like(returned)
        pair_out[order] = returned
        by_expert = flat_ids.argsort(stable=True)
        return combine_pairs(x, pair_out[by_expert], topk_weights, by_expert, top_k)

    def move_to(self, new: np.ndarray) -> None:
        """Adopt placement `new` [P], moving expert weights between ranks: a slot whose expert
        this rank already holds copies it locally, the others receive it from the lowest rank
        holding it now. Every rank derives the same transfers from the two placements."""
        ep, slots = self.ep, self.slots
        old = self.physical_to_logical
        holders: dict[int, list[int]] = {}
        for physical, logical in enumerate(old):
            holders.setdefault(int(logical), []).append(physical // slots)
        sends: list[list[int]] = [[] for _ in range(ep.size)]  # old local slots this rank sends to each rank
        receives: list[list[int]] = [[] for _ in range(ep.size)]  # new local slots filled from each rank
        local: list[tuple[int, int]] = []  # (new slot, old slot) copies within this rank
        for rank in range(ep.size):
            held_there = [int(e) for e in old[rank * slots : (rank + 1) * slots]]
            for slot in range(slots):
                logical = int(new[rank * slots + slot])
                if logical in held_there:
                    if rank == ep.rank:
                        local.append((slot, held_there.index(logical)))
                    continue
                source = min(holders[logical])
                if source == ep.rank:
                    mine = [int(e) for e in old[ep.rank * slots : (ep.rank + 1) * slots]]
                    sends[rank].append(mine.index(logical))
                if rank == ep.rank:
                    receives[source].append(slot)
        width13 = self.w13[0].numel()
        flat = torch.cat([self.w13.reshape(slots, -1), self.w2.reshape(slots, -1)], dim=1)  # [S, n13 + n2]
        outgoing = flat[[s for per_rank in sends for s in per_rank]]
        incoming = ep.comm.all_to_all(outgoing, [len(s) for s in sends], [len(r) for r in receives])
        moved = torch.empty_like(flat)
        for new_slot, old_slot in local:
            moved[new_slot] = flat[old_slot]
        for row, new_slot in enumerate(s for per_rank in receives for s in per_rank):
            moved[new_slot] = incoming[row]
        self.w13.data = moved[:, :width13].reshape(self.w13.shape).contiguous()
        self.w2.data = moved[:, width13:].reshape(self.w2.shape).contiguous()
        self.place(new)


class ExpertBalancer:
    """EPLB over a model's expert-parallel layers: every `interval` forwards (counted alike on
    every rank, which all run the same forwards) the loads recorded since the last rebalance are
    summed over the ranks, a new placement computed, and the weights moved."""

    def __init__(
        self,
        layers: list[ExpertParallelExperts],
        ep: ExpertParallel,
        interval: int,
        *,
        num_groups: int = 1,
        num_nodes: int = 1,
        policy: str = "auto",
    ) -> None:
        self.layers = layers
        self.ep = ep
        self.interval = interval
        self.num_groups, self.num_nodes, self.policy = num_groups, num_nodes, policy
        self.steps = 0
        self.num_rebalances = 0
        self.last_balancedness: tuple[float, float] | None = None  # (before, after) the last move

    def step_done(self) -> None:
        self.steps += 1
        if self.steps % self.interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        device = self.layers[0].w13.device
        load = torch.stack(
            [
                torch.zeros(layer.num_logical, dtype=torch.int64, device=device)
                if layer.load is None
                else layer.load
                for layer in self.layers
            ]
        )  # [layers, E]
        self.ep.comm.all_reduce(load)
        total = load.cpu().numpy()
        if not total.any():
            return
        current = Placement(np.stack([layer.physical_to_logical for layer in self.layers]))
        placement = rebalance(
            total,
            self.layers[0].num_physical,
            self.ep.size,
            num_groups=self.num_groups,
            num_nodes=self.num_nodes,
            policy=self.policy,
        )
        before = balancedness(total, current, self.ep.size)
        after = balancedness(total, placement, self.ep.size)
        for layer in self.layers:
            layer.load = None
        if after <= before:  # every rank computed the same numbers: all keep their experts
            return
        for layer, row in zip(self.layers, placement.physical_to_logical):
            layer.move_to(row)
        self.num_rebalances += 1
        self.last_balancedness = (before, after)
        log.info("EPLB: experts re-placed, balancedness %.3f -> %.3f", before, after)
