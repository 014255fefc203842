"""Manifold-constrained hyper-connections (mHC): the residual as `hc_mult` parallel streams.

Around every attention and MoE block, one linear map of the RMS-normalised, flattened streams
[N * D] gives three sets of mixing weights per token:
- pre [N]: sigmoid, collapses the N streams into the block's input;
- post [N]: 2 * sigmoid, spreads the block's output back over the streams;
- comb [N, N]: softmax rows, then Sinkhorn-Knopp alternating column / row normalisation towards a
  doubly-stochastic matrix; the new streams are post * output + comb^T @ streams.
The hyper head before the LM head collapses the final streams with its own sigmoid weights.

Shifted (DeepSeek-V4.1's default): each block collapses the streams with the pre weights the
block before it computed (the first block reads stream 0, which the embedding filled like all
the others), and hands its own pre weights on; the last block's pre weights collapse the final
streams, so there is no hyper head. post and comb are used as in the plain form.
All mixing weights are computed in float32 (the parameters are kept in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.norm import unweighted_rms_norm


def _fp32_param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


class HyperConnection(torch.nn.Module):
    def __init__(
        self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = (
            hc_mult,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        )
        mixes = (2 + hc_mult) * hc_mult
        self.fn = _fp32_param(mixes, hc_mult * hidden_size)
        self.base = _fp32_param(mixes)
        self.scale = _fp32_param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (block input [T, D], post [T, N] fp32, comb [T, N, N] fp32)."""
        pre, post, comb = self.mixes(streams)
        return self.collapse(streams, pre), post, comb

    def forward_shifted(
        self, streams: torch.Tensor, carried_pre: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shifted form: streams [T, N, D] and the previous block's pre [T, N] -> (block input
        [T, D] collapsed with carried_pre, post [T, N], comb [T, N, N], pre [T, N] to carry on)."""
        pre, post, comb = self.mixes(streams)
        return self.collapse(streams, carried_pre), post, comb, pre

    def mix(
        self, streams: torch.Tensor, pre: torch.Tensor | None, shifted: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Either form for a block: the shifted one collapses with the carried `pre` and returns
        its own to carry on; the plain one carries nothing (None)."""
        if shifted:
            assert pre is not None, "a shifted block needs the previous block's pre weights"
            return self.forward_shifted(streams, pre)
        collapsed, post, comb = self(streams)
        return collapsed, post, comb, None

    @staticmethod
    def first_pre(num_tokens: int, hc_mult: int, device: torch.device | None = None) -> torch.Tensor:
        """The pre weights the first shifted block collapses with: stream 0 alone. [T, N] fp32."""
        pre = torch.zeros(num_tokens, hc_mult, device=device)
        pre[:, 0] = 1.0
        return pre

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_i pre[i] * streams[i]: [T, N, D], [T, N] -> [T, D]."""
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (pre [T, N], post [T, N], comb [T, N, N]), all fp32."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())  # [T, (2 + N) N]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        base = self.base.float()
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def expand(
        streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New streams [T, N, D]: post[j] * output + sum_i comb[i, j] * streams[i]."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class HyperHead(torch.nn.Module):
    """Collapses the final streams [T, N, D] into one hidden state [T, D] before the final norm."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = _fp32_param(hc_mult, hc_mult * hidden_size)
        self.base = _fp32_param(hc_mult)
        self.scale = _fp32_param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
