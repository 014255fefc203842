"""Expert-load balancing (EPLB): where the physical experts of each MoE layer go, given how many
tokens every logical expert received. Torch-free (numpy), deterministic: every rank computes the
same placement from the same loads.

A layer has E logical experts and P >= E physical slots, P / R on each of R ranks. The policy
1. gives every logical expert one replica and each of the P - E redundant slots to the expert
   whose load per replica is highest (a replica serves an equal share of its expert's tokens);
2. packs the replicas onto ranks, heaviest first, each onto the least loaded rank that has a free
   slot and, when it can, no replica of the same expert yet.
The hierarchical policy first packs whole expert groups onto nodes (DeepSeek's routing keeps a
token within a few groups, so a node then serves most of its tokens' experts), and runs the two
steps above within each node; the global policy runs them over all ranks at once.

Balancedness of a placement is mean / max of the per-rank loads, averaged over layers (1.0: even).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Placement:
    physical_to_logical: np.ndarray  # [layers, P] the logical expert each physical slot holds

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    def replica_counts(self, num_logical: int) -> np.ndarray:  # [layers, E]
        return np.stack([np.bincount(row, minlength=num_logical) for row in self.physical_to_logical])


def identity_placement(num_layers: int, num_logical: int, num_physical: int) -> Placement:
    """Before any load is known: slot p holds expert p, the redundant slots experts 0, 1, ..."""
    row = np.arange(num_physical) % num_logical
    return Placement(np.tile(row, (num_layers, 1)))


def rank_loads(load: np.ndarray, placement: Placement, num_ranks: int) -> np.ndarray:
    """Tokens each rank serves [layers, R], each expert's load split evenly over its replicas."""
    num_logical = load.shape[1]
    counts = placement.replica_counts(num_logical)
    p2l = placement.physical_to_logical
    per_replica = np.take_along_axis(load / np.maximum(counts, 1), p2l, axis=1)  # [layers, P]
    return per_replica.reshape(load.shape[0], num_ranks, -1).sum(axis=2)


def balancedness(load: np.ndarray, placement: Placement, num_ranks: int) -> float:
    per_rank = rank_loads(np.asarray(load, dtype=np.float64), placement, num_ranks)
    peak = per_rank.max(axis=1)
    ratios = np.where(peak > 0, per_rank.mean(axis=1) / np.where(peak > 0, peak, 1), 1.0)
    return float(ratios.mean())


def _replicate(load: np.ndarray, num_physical: int) -> np.ndarray:
    """Replica count per expert: one each, then every extra slot to the highest load per replica."""
    counts = np.ones(load.shape[0], dtype=np.int64)
    for _ in range(num_physical - load.shape[0]):
        counts[int(np.argmax(load / counts))] += 1
    return counts


def _pack(weights: np.ndarray, keys: np.ndarray, num_bins: int, per_bin: int) -> np.ndarray:
    """Bin of each item: heaviest first onto the lightest bin with room, avoiding a bin that
    already holds an item of the same key while another bin with room does not."""
    bins = np.full(weights.shape[0], -1, dtype=np.int64)
    totals = np.zeros(num_bins)
    sizes = np.zeros(num_bins, dtype=np.int64)
    held: list[set[int]] = [set() for _ in range(num_bins)]
    for item in np.argsort(-weights, kind="stable"):
        open_bins = [b for b in range(num_bins) if sizes[b] < per_bin]
        fresh = [b for b in open_bins if int(keys[item]) not in held[b]] or open_bins
        chosen = min(fresh, key=lambda b: (totals[b], b))
        bins[item] = chosen
        totals[chosen] += weights[item]
        sizes[chosen] += 1
        held[chosen].add(int(keys[item]))
    return bins


def _place_layer(load: np.ndarray, experts: np.ndarray, num_physical: int, num_ranks: int) -> np.ndarray:
    """physical_to_logical [num_physical] for `experts` (logical ids, their loads `load`) over
    `num_ranks` ranks, rank by rank, each rank's slots heaviest replica first."""
    counts = _replicate(load, num_physical)
    replica_of = np.repeat(np.arange(experts.shape[0]), counts)  # index into `experts`
    weights = (load / counts)[replica_of]
    bins = _pack(weights, replica_of, num_ranks, num_physical // num_ranks)
    out = []
    for rank in range(num_ranks):
        mine = [i for i in np.argsort(-weights, kind="stable") if bins[i] == rank]
        out.extend(int(experts[replica_of[i]]) for i in mine)
    return np.asarray(out, dtype=np.int64)


def _hierarchical_layer(
    load: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> np.ndarray:
    num_logical = load.shape[0]
    group_size = num_logical // num_groups
    group_load = load.reshape(num_groups, group_size).sum(axis=1)
    node_of_group = _pack(group_load, np.arange(num_groups), num_nodes, num_groups // num_nodes)
    out = []
    for node in range(num_nodes):
        groups = np.flatnonzero(node_of_group == node)
        experts = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        out.append(_place_layer(load[experts], experts, num_physical // num_nodes, num_ranks // num_nodes))
    return np.concatenate(out)


def choose_policy(policy: str, num_groups: int, num_nodes: int, num_ranks: int) -> str:
    """auto: hierarchical when expert groups and ranks divide evenly over the nodes (and there is
    more than one node), else global."""
    if policy != "auto":
        return policy
    fits = num_nodes > 1 and num_groups % num_nodes == 0 and num_ranks % num_nodes == 0
    return "hierarchical" if fits else "global"


def rebalance(
    load: np.ndarray,
    num_physical: int,
    num_ranks: int,
    *,
    num_groups: int = 1,
    num_nodes: int = 1,
    policy: str = "auto",
) -> Placement:
    """The placement of every layer from its load [layers, E] (token counts, any scale)."""
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_logical = load.shape
    if num_physical < num_logical or num_physical % num_ranks:
        raise ValueError(
            f"{num_physical} physical experts must cover the {num_logical} logical ones and divide over "
            f"{num_ranks} ranks"
        )
    chosen = choose_policy(policy, num_groups, num_nodes, num_ranks)
    rows = []
    for layer in range(num_layers):
        if chosen == "hierarchical":
            if num_groups % num_nodes or num_ranks % num_nodes or num_logical % num_groups:
                raise ValueError(
                    f"hierarchical EPLB needs the {num_groups} expert groups and {num_ranks} ranks to divide "
                    f"over {num_nodes} nodes"
                )
            rows.append(_hierarchical_layer(load[layer], num_physical, num_groups, num_nodes, num_ranks))
        else:
            rows.append(_place_layer(load[layer], np.arange(num_logical), num_physical, num_ranks))
    return Placement(np.stack(rows))
