"""The parts a DeepSeek-V4.1 block builds the same way in the target model and in a DSpark draft
layer: the routed MoE (sqrtsoftplus scores, an image routing bias) and the two mHC mixers."""

from __future__ import annotations

from deepinfer.model.deepseek_v4.mhc import HyperConnection
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch, MoeSpec


def v41_moe(arch: DeepseekV41Arch, moe: MoeSpec) -> V4MoE:
    """A V4.1 MoE of `moe`'s experts. `gate.bias_vl` is always built, as the checkpoint has it
    (the draft layers' tokens are text, so it is never added there)."""
    return V4MoE(
        arch.hidden_size,
        moe.intermediate_size,
        moe.num_experts,
        moe.top_k,
        "sqrtsoftplus",
        moe.routed_scaling_factor,
        arch.swiglu_limit,
        None,
        image_bias=True,
    )


def v41_hyper_connections(arch: DeepseekV41Arch) -> tuple[HyperConnection, HyperConnection]:
    """The mHC mixers around a block's attention and its FFN."""
    mhc = (arch.hidden_size, arch.hc_mult, arch.hc_sinkhorn_iters, arch.hc_eps, arch.rms_norm_eps)
    return HyperConnection(*mhc), HyperConnection(*mhc)
