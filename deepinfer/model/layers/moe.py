"""DeepSeekMoE: group-limited top-k routing, routed experts executed grouped by expert, shared experts.

Routing (per token, in float32):
- scores: sigmoid (V3) or softmax (V2) of the router logits;
- noaux_tc (V3): experts are chosen on score + e_score_correction_bias, groups ranked by the sum of
  their two best biased scores; the weights are the unbiased scores of the chosen experts;
- group_limited_greedy (V2): groups ranked by their best score; greedy: no groups;
- then optional normalisation of the chosen weights and the routed scaling factor.

Execution: the (token, expert) pairs are sorted by expert, each active expert runs one matmul over
its tokens, and results are scattered back with index_add. Experts live in stacked tensors
[E, ...]. Expert parallelism (layers/expert_parallel.py) sends each (token, expert) pair to the
rank holding a replica of its expert and runs the same per-expert matmuls there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model.layers.expert_parallel import ExpertParallelExperts, combine_pairs, run_experts
from deepinfer.model.layers.mlp import GatedMLP
from deepinfer.model.layers.parallel_linear import Segment
from deepinfer.model.parallel import SINGLE, ExpertParallel, TensorParallel, split_evenly


@dataclass(slots=True, frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    num_groups: int = 1
    topk_groups: int = 1
    scoring: str = "sigmoid"  # "sigmoid" | "softmax"
    topk_method: str = "noaux_tc"  # "noaux_tc" | "group_limited_greedy" | "greedy"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {self.scoring!r}")
        if self.topk_method not in ("noaux_tc", "group_limited_greedy", "greedy"):
            raise ValueError(f"unsupported topk_method {self.topk_method!r}")
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"n_routed_experts={self.num_experts} is not divisible by n_group={self.num_groups}"
            )
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in 1..n_group={self.num_groups}")


class GroupedTopKRouter(torch.nn.Module):
    """Router weights and bias stay float32 whatever the model dtype (load_weights keeps them so)."""

    def __init__(self, hidden_size: int, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            torch.nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
            if cfg.topk_method == "noaux_tc"
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            choice = _keep_top_groups(choice, group_scores, cfg, float("-inf"))
            ids = choice.topk(cfg.top_k, dim=-1).indices
        elif cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups).amax(dim=-1)
            ids = _keep_top_groups(scores, group_scores, cfg, 0.0).topk(cfg.top_k, dim=-1).indices
        else:
            ids = scores.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


def _keep_top_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, cfg: RouterConfig, fill: float
) -> torch.Tensor:
    """scores [T, E] with experts outside each token's topk_groups best groups set to `fill`."""
    if cfg.topk_groups == cfg.num_groups:
        return scores
    top_groups = group_scores.topk(cfg.topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    keep = keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1)  # [T, E]
    return scores.masked_fill(~keep, fill)


class RoutedExperts(torch.nn.Module):
    """Stacked SwiGLU experts: w13 [E, 2I, hidden] (gate rows then up rows), w2 [E, hidden, I];
    `swiglu_limit` clamps the gate and up activations (DeepSeek-V4)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None
    ) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w13 = torch.nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        first_expert: int = 0,
        fused: bool = False,
    ) -> torch.Tensor:
        """Sum over each token's chosen experts in [first_expert, first_expert + E_local) of
        weight * expert(x): x [T, hidden], topk_* [T, k] -> [T, hidden]. `fused`: every expert
        local (first_expert 0), the experts run as the Triton fused MoE's grouped GEMMs."""
        num_local = self.w13.shape[0]
        top_k = topk_ids.shape[1]
        if fused:
            if first_expert != 0:
                raise ValueError("the fused MoE runs every expert of the layer (first_expert 0)")
            # Imported on use: Triton is an optional dependency, needed only on this path.
            from deepinfer.kernels.triton import fused_moe

            order, pair_out = fused_moe.expert_pairs(x, topk_ids, self.w13, self.w2, self.swiglu_limit)
            return combine_pairs(x, pair_out, topk_weights, order, top_k)
        flat_ids = topk_ids.flatten() - first_expert  # [T * k], pair p belongs to token p // k
        local = (flat_ids >= 0) & (flat_ids < num_local)
        pairs = local.nonzero().squeeze(1)
        order = pairs[flat_ids[pairs].argsort(stable=True)]  # local pairs sorted by expert
        counts = torch.bincount(flat_ids[order], minlength=num_local).tolist()
        out_rows = run_experts(
            x[order // top_k], counts, self.w13, self.w2, self.swiglu_limit
        )  # grouped by expert
        return combine_pairs(x, out_rows, topk_weights, order, top_k)


class DeepseekMoE(torch.nn.Module):
    """Without expert parallelism every rank holds every expert's share of the intermediate
    dimension (tensor parallel; the whole experts in one process) and the partial outputs are
    summed. With it, each rank of a tensor-parallel group routes its share of the tokens through
    the expert-parallel dispatch (experts whole, shared experts local) and the group gathers the
    rows back."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_shared_experts: int,
        router: RouterConfig,
        tp: TensorParallel = SINGLE,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.ep = tp, ep
        self.gate = GroupedTopKRouter(hidden_size, router)
        shared = moe_intermediate_size * num_shared_experts
        if ep is None:
            columns = Segment.even(moe_intermediate_size, tp)
            self.experts: torch.nn.Module = RoutedExperts(router.num_experts, hidden_size, columns.local)
            self.experts.splits = {"w13": (0, [columns, columns]), "w2": (1, [columns])}
            self.shared_experts = GatedMLP(hidden_size, shared, tp, reduce=False) if shared else None
        else:
            self.experts = ExpertParallelExperts(router.num_experts, hidden_size, moe_intermediate_size, ep)
            self.shared_experts = GatedMLP(hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `fused`: the routed experts run the Triton fused MoE
        (the router is the same: the kernel only takes its top-k ids and weights)."""
        if self.ep is None:
            weights, ids = self.gate(x)
            out = self.experts(x, weights, ids, fused=fused)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return self.tp.all_reduce(out)
        counts = [
            hi - lo for lo, hi in (split_evenly(x.shape[0], self.tp.size, r) for r in range(self.tp.size))
        ]
        lo = sum(counts[: self.tp.rank])
        mine = x[lo : lo + counts[self.tp.rank]]  # this rank's share of the group's tokens
        weights, ids = self.gate(mine)
        out = self.experts(mine, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(mine)
        return self.tp.gather_rows(out, counts)
