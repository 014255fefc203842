"""Load DeepSeek-V4 checkpoints: official tensor names onto DeepseekV4ForCausalLM's parameters.

Names are DeepSeek's (`embed.weight`, `layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{e}.w1
.weight`, `layers.{i}.hc_attn_fn`, `mtp.{d}.e_proj.weight`, ...), optionally under `model.`, and
the spellings transformers' save_pretrained leaves behind (`embed_tokens.weight`,
`lm_head.weight`, `hc_head.hc_fn`, `attn.norm.weight` for kv_norm) are accepted too.

Quantized weights come with a scale named `X.scale` (DeepSeek) or `X.weight_scale_inv`:
- float8 weights: block scales (quantization_config.weight_block_size, 128x128), e8m0 or float;
- int8/uint8 routed experts: MXFP4 (e2m1 pairs, one e8m0 scale per 32 inputs).
Both are dequantized on the way in (`scaled_format`, for loader/scaled.py). Routed experts are stacked into [E, ...] tensors (w1 = gate rows, w3 =
up rows, w2 = down). Mixing weights, norms, sinks, position biases and the router stay float32.
This file holds only the name mapping; loader/weights.py writes the tensors, and makes every
missing, unexpected, duplicated or mis-shaped tensor an error that names it. A model built for one
rank of several takes only its part of each tensor (loader/shards.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.deepseek_v4.mxfp4 import PACKED_DTYPES, dequantize_mxfp4, scale_to_float
from deepinfer.model.layers.fp8 import FP8_DTYPES, dequantize_block_fp8
from deepinfer.model.loader.scaled import ScaledFormat, dequantized
from deepinfer.model.loader.weights import NameMap, Target, WeightLoader

_LAYER = re.compile(r"(layers|mtp)\.(\d+)\.(.+)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_ROUTED_EXPERT = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
_SHARED = re.compile(r"ffn\.shared_experts\.(w1|w2|w3)\.weight")
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")
_HC_HEAD = re.compile(r"hc_head(?:_|\.hc_)(fn|base|scale)")
_MTP_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight")
_MTP_TIED = ("embed.weight", "head.weight")
_FP32 = re.compile(
    r".*(norm\.weight|attn_sink|\.ape|ffn\.gate\.weight|ffn\.gate\.bias|hc_(attn|ffn|head)\..*)"
)


def _scale_owner(name: str) -> str | None:
    if name.endswith("_scale_inv"):
        return name.removesuffix("_scale_inv")
    if name.endswith(".scale"):
        return name.removesuffix(".scale") + ".weight"
    return None


def scaled_format(block: tuple[int, int]) -> ScaledFormat:
    """DeepSeek-V4's quantized weights, for loader/scaled.py: float8 with block scales (e8m0 or
    float, named `X.scale` or `X.weight_scale_inv`) and MXFP4 routed experts."""

    def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        try:
            if weight.dtype in FP8_DTYPES:
                return dequantize_block_fp8(weight, scale_to_float(scale), block)
            if _ROUTED_EXPERT.search(name):
                return dequantize_mxfp4(weight, scale)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
        raise ValueError(f"{name!r} is packed {weight.dtype} (MXFP4), which only routed experts may be")

    return ScaledFormat(
        scale_owner=_scale_owner,
        quantized=FP8_DTYPES + PACKED_DTYPES,
        dequantize=dequantize,
        scale_on_unquantized="{name} has a quantization scale but is stored as {dtype}",
        weights_without_scale="quantized weights without their scale: {names}",
        scales_without_weight="quantization scales without their weight: {owners}",
    )


def canonical_name(name: str) -> str:
    """DeepSeek's spelling of a checkpoint name (drops `model.`, maps transformers' leftovers)."""
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}[name]
    head = _HC_HEAD.fullmatch(name)
    if head is not None:
        return f"hc_head_{head.group(1)}"
    return re.sub(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


class _V4Names(NameMap):
    """DeepSeek's names (and transformers' leftovers) onto DeepseekV4ForCausalLM: w1 / w3 as the
    halves of the stacked experts' w13 and of the shared experts' gate_up_proj, MTP modules as
    `mtp.{d}` (or layers after the backbone)."""

    loads_buffers = True

    def __init__(self, arch: DeepseekV4Arch) -> None:
        self.arch = arch

    def key(self, name: str) -> str:
        return canonical_name(name)

    def keeps_float32(self, param: str) -> bool:
        return _FP32.fullmatch(param) is not None

    def route(self, loader: WeightLoader, name: str, key: str) -> Target | None:
        arch = self.arch
        if key in ("embed.weight", "norm.weight"):
            return Target(key)
        if key == "head.weight":
            return None if loader.model.head is None else Target("head")
        if key.startswith("hc_head_"):
            return Target(f"hc_head.{key.removeprefix('hc_head_')}")
        match = _LAYER.fullmatch(key)
        if match is None:
            raise ValueError(f"unexpected weight {name!r} for DeepSeek-V4")
        group, index, rest = match.group(1), int(match.group(2)), match.group(3)
        if group == "layers" and index < arch.num_layers:
            return self._block(loader, name, f"layers.{index}.", rest)
        depth = index if group == "mtp" else index - arch.num_layers
        if depth >= arch.num_mtp_layers:
            if arch.num_mtp_layers == 0:
                return None  # MTP weights present, disabled by num_nextn_predict_layers = 0
            raise ValueError(
                f"unexpected weight {name!r}: MTP module {depth} is beyond "
                f"num_nextn_predict_layers={arch.num_mtp_layers}"
            )
        if rest in _MTP_TIED:
            return None  # the MTP module shares the main model's embedding and head
        if rest in _MTP_OWN:
            return _generic(loader, name, f"mtp.{depth}.{rest}")
        head = _HC_HEAD.fullmatch(rest)
        if head is not None:
            return Target(f"mtp.{depth}.hc_head.{head.group(1)}")
        return self._block(loader, name, f"mtp.{depth}.block.", rest)

    def _block(self, loader: WeightLoader, name: str, prefix: str, rest: str) -> Target:
        hc = _HC.fullmatch(rest)
        if hc is not None:
            return _generic(loader, name, f"{prefix}hc_{hc.group(1)}.{hc.group(2)}")
        if rest == "ffn.gate.tid2eid":
            return Target(_generic(loader, name, prefix + rest).param, None, self._expert_ids(name))
        half = self.arch.moe_intermediate_size
        expert = _EXPERT.fullmatch(rest)
        if expert is not None:
            number, kind = int(expert.group(1)), expert.group(2)
            if number >= self.arch.num_experts:
                raise ValueError(f"unexpected weight {name!r}: n_routed_experts={self.arch.num_experts}")
            if kind == "w2":
                return Target(f"{prefix}ffn.experts.w2", number)
            rows = slice(0, half) if kind == "w1" else slice(half, 2 * half)
            return Target(f"{prefix}ffn.experts.w13", (number, rows))
        shared = _SHARED.fullmatch(rest)
        if shared is not None:
            kind = shared.group(1)
            if kind == "w2":
                return Target(f"{prefix}ffn.shared_experts.down_proj")
            rows = slice(0, half) if kind == "w1" else slice(half, 2 * half)
            return Target(f"{prefix}ffn.shared_experts.gate_up_proj", rows)
        return _generic(loader, name, prefix + rest)

    def _expert_ids(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hash-routing table as it is, once its ids are checked to be experts."""
        experts = self.arch.num_experts

        def check(table: torch.Tensor) -> torch.Tensor:
            if table.is_floating_point() or int(table.min()) < 0 or int(table.max()) >= experts:
                raise ValueError(f"weight {name!r}: expert ids must be integers in 0..{experts - 1}")
            return table

        return check


def _generic(loader: WeightLoader, name: str, target: str) -> Target:
    """Norms keep their `.weight`; plain matrices are parameters without it."""
    unexpected = ValueError(f"unexpected weight {name!r} for this DeepSeek-V4 config")
    return loader.candidate((target, target.removesuffix(".weight")), unexpected)


def load_v4_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` into `model` (a DeepseekV4ForCausalLM), dequantizing on the way; drops the
    MTP modules when the checkpoint has none of their weights."""
    loader = WeightLoader(model, _V4Names(model.arch))
    loader.load_all(dequantized(weights, scaled_format(model.arch.fp8_block)))
    loader.drop_if_unloaded("mtp", "no MTP weights in the checkpoint: multi-token prediction disabled")
    loader.finish()
