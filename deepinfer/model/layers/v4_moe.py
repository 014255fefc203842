"""DeepSeek-V4's MoE block: routed experts chosen by a learned router or a fixed token table.

Routing, per token in float32:
- scores: sqrt(softplus(logits)) (V4's default; sigmoid and softmax also accepted);
- "moe" layers pick the top-k experts on score + e_score_correction_bias (noaux balancing);
  "hash_moe" layers take them from the frozen table tid2eid[token id] instead;
- the chosen experts' unbiased scores are normalised to sum to 1 and times routed_scaling_factor.
Experts and the one shared expert are SwiGLU with clamped activations (swiglu_limit).

Over several ranks, as DeepSeek-V3's DeepseekMoE (layers/moe.py): the router, its correction
bias and the hash table are replicated (every rank routes the tokens it runs). Under tensor
parallelism alone every rank holds its share of every expert's intermediate dimension (and of the
shared expert's) and the partial outputs are summed once; with expert parallelism the experts are
whole and sharded over the ranks, each rank of a tensor-parallel group dispatches its share of the
group's tokens, runs the shared expert on them, and the group gathers the rows back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.layers.expert_parallel import ExpertParallelExperts
from deepinfer.model.layers.mlp import GatedMLP
from deepinfer.model.layers.moe import RoutedExperts
from deepinfer.model.layers.parallel_linear import Segment
from deepinfer.model.parallel import SINGLE, ExpertParallel, TensorParallel, split_evenly


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class V4Router(torch.nn.Module):
    """Router weight (and correction bias) are kept in float32; tid2eid is an int64 buffer."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str,
        routed_scaling_factor: float,
        hash_vocab_size: int | None,
    ) -> None:
        super().__init__()
        self.top_k, self.scoring_func, self.routed_scaling_factor = top_k, scoring_func, routed_scaling_factor
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        if hash_vocab_size is None:
            self.bias = torch.nn.Parameter(torch.empty(num_experts), requires_grad=False)
            self.tid2eid = None
        else:
            self.bias = None
            self.register_buffer("tid2eid", torch.empty(hash_vocab_size, top_k, dtype=torch.int64))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], token_ids [T] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        scores = router_scores(F.linear(x.float(), self.weight.float()), self.scoring_func)  # [T, E]
        if self.tid2eid is None:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1).indices
        else:
            ids = self.tid2eid[token_ids]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class V4MoE(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str,
        routed_scaling_factor: float,
        swiglu_limit: float,
        hash_vocab_size: int | None,
        tp: TensorParallel = SINGLE,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.ep = tp, ep
        self.gate = V4Router(
            hidden_size, num_experts, top_k, scoring_func, routed_scaling_factor, hash_vocab_size
        )
        if ep is None:
            columns = Segment.even(intermediate_size, tp)
            self.experts: torch.nn.Module = RoutedExperts(
                num_experts, hidden_size, columns.local, swiglu_limit
            )
            self.experts.splits = {"w13": (0, [columns, columns]), "w2": (1, [columns])}
            self.shared_experts = GatedMLP(
                hidden_size, intermediate_size, tp, reduce=False, swiglu_limit=swiglu_limit
            )
        else:
            self.experts = ExpertParallelExperts(
                num_experts, hidden_size, intermediate_size, ep, swiglu_limit
            )
            self.shared_experts = GatedMLP(hidden_size, intermediate_size, swiglu_limit=swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], token_ids [T] -> [T, hidden]."""
        if self.ep is None:
            weights, ids = self.gate(x, token_ids)
            return self.tp.all_reduce(self.experts(x, weights, ids) + self.shared_experts(x))
        counts = [
            hi - lo for lo, hi in (split_evenly(x.shape[0], self.tp.size, r) for r in range(self.tp.size))
        ]
        lo = sum(counts[: self.tp.rank])
        rows = slice(lo, lo + counts[self.tp.rank])  # this rank's share of the group's tokens
        mine = x[rows]
        weights, ids = self.gate(mine, token_ids[rows])
        out = self.experts(mine, weights, ids) + self.shared_experts(mine)
        return self.tp.gather_rows(out, counts)
