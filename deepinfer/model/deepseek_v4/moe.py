"""DeepSeek-V4's MoE block: routed experts chosen by a learned router or a fixed token table.

Routing, per token in float32:
- scores: sqrt(softplus(logits)) (V4's default; sigmoid and softmax also accepted);
- "moe" layers pick the top-k experts on score + e_score_correction_bias (noaux balancing), ties
  to the lower expert id as DeepSeek's gate kernel breaks them; V4.1's routers hold a second bias
  (`bias_vl`) that takes the first one's place for the tokens an image mask marks, in the choice
  only; "hash_moe" layers take them from the frozen table tid2eid[token id] instead;
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


def top_k_lowest_on_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] -> the k highest per row [T, k], descending, an equal score going to the lower
    column (torch.topk leaves ties unordered: on the CPU it can return the higher one)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


class V4Router(torch.nn.Module):
    """Router weight (and correction biases) are kept in float32; tid2eid is an int64 buffer.
    `image_bias`: the router also holds V4.1's `bias_vl`, the correction bias of image tokens."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str,
        routed_scaling_factor: float,
        hash_vocab_size: int | None,
        image_bias: bool = False,
    ) -> None:
        super().__init__()
        self.top_k, self.scoring_func, self.routed_scaling_factor = top_k, scoring_func, routed_scaling_factor
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        if image_bias and hash_vocab_size is not None:
            raise ValueError("a hash-routed layer has no correction bias, hence no image one")
        if image_bias:
            # A buffer out of the state dict: the router's state dict stays V4's, so a V4.1 block's
            # loads into a V4 block (the loaders fill it by name, as a parameter).
            self.register_buffer("bias_vl", torch.empty(num_experts), persistent=False)
        else:
            self.bias_vl = None
        if hash_vocab_size is None:
            self.bias = torch.nn.Parameter(torch.empty(num_experts), requires_grad=False)
            self.tid2eid = None
        else:
            self.bias = None
            self.register_buffer("tid2eid", torch.empty(hash_vocab_size, top_k, dtype=torch.int64))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, image_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], token_ids [T], image_mask [T] bool (None: all text)
        -> (weights [T, k] float32, expert ids [T, k] int64)."""
        scores = router_scores(F.linear(x.float(), self.weight.float()), self.scoring_func)  # [T, E]
        if image_mask is not None and self.bias_vl is None:
            raise ValueError("an image mask needs a router with an image-token bias (V4.1's bias_vl)")
        if self.tid2eid is None:
            bias = self.bias.float()  # [E]
            if image_mask is not None:
                bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl.float(), bias)  # [T, E]
            ids = top_k_lowest_on_ties(scores + bias, self.top_k)
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
        image_bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp, self.ep = tp, ep
        self.gate = V4Router(
            hidden_size, num_experts, top_k, scoring_func, routed_scaling_factor, hash_vocab_size, image_bias
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

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        image_mask: torch.Tensor | None = None,
        fused: bool = False,
    ) -> torch.Tensor:
        """x [T, hidden], token_ids [T], image_mask [T] bool (None: all text) -> [T, hidden];
        `fused`: the routed experts run the Triton fused MoE (without expert parallelism)."""
        if self.ep is None:
            weights, ids = self.gate(x, token_ids, image_mask)
            return self.tp.all_reduce(self.experts(x, weights, ids, fused=fused) + self.shared_experts(x))
        counts = [
            hi - lo for lo, hi in (split_evenly(x.shape[0], self.tp.size, r) for r in range(self.tp.size))
        ]
        lo = sum(counts[: self.tp.rank])
        rows = slice(lo, lo + counts[self.tp.rank])  # this rank's share of the group's tokens
        mine = x[rows]
        weights, ids = self.gate(mine, token_ids[rows], None if image_mask is None else image_mask[rows])
        out = self.experts(mine, weights, ids) + self.shared_experts(mine)
        return self.tp.gather_rows(out, counts)
