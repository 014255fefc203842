"""Load DeepSeek-V4 checkpoints: official tensor names onto DeepseekV4ForCausalLM's parameters.

Names are DeepSeek's (`embed.weight`, `layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{e}.w1
.weight`, `layers.{i}.hc_attn_fn`, `mtp.{d}.e_proj.weight`, ...), optionally under `model.`, and
the spellings transformers' save_pretrained leaves behind (`embed_tokens.weight`,
`lm_head.weight`, `hc_head.hc_fn`, `attn.norm.weight` for kv_norm) are accepted too.

Quantized weights come with a scale named `X.scale` (DeepSeek) or `X.weight_scale_inv`:
- float8 weights: block scales (quantization_config.weight_block_size, 128x128), e8m0 or float;
- int8/uint8 routed experts: MXFP4 (e2m1 pairs, one e8m0 scale per 32 inputs).
Both are dequantized here. Routed experts are stacked into [E, ...] tensors (w1 = gate rows, w3 =
up rows, w2 = down). Mixing weights, norms, sinks, position biases and the router stay float32.
Every missing, unexpected, duplicated or mis-shaped tensor is an error that names it. A model
built for one rank of several takes only its part of each tensor (loader/shards.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from deepinfer.model.layers.fp8 import FP8_DTYPES, dequantize_block_fp8
from deepinfer.model.layers.mxfp4 import PACKED_DTYPES, dequantize_mxfp4, scale_to_float
from deepinfer.model.loader.shards import ShardMap

log = logging.getLogger(__name__)

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
# Where a tensor goes: parameter (or buffer) name and the index into it (None: all of it).
_Target = tuple[str, Any]


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pairs every quantized weight with its scale (either may come first) and yields the float32
    weight under the weight's name; everything else passes through."""
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        owner = _scale_owner(name)
        if owner is not None:
            weight = pending_weights.pop(owner, None)
            if weight is None:
                pending_scales[owner] = tensor
            else:
                yield owner, _dequantize(owner, weight, tensor, block)
        elif tensor.dtype in FP8_DTYPES or tensor.dtype in PACKED_DTYPES:
            scale = pending_scales.pop(name, None)
            if scale is None:
                pending_weights[name] = tensor
            else:
                yield name, _dequantize(name, tensor, scale, block)
        else:
            if name in pending_scales:
                raise ValueError(f"{name!r} has a quantization scale but is stored as {tensor.dtype}")
            yield name, tensor
    if pending_weights:
        raise ValueError(f"quantized weights without their scale: {sorted(pending_weights)[:8]}")
    if pending_scales:
        raise ValueError(f"quantization scales without their weight: {sorted(pending_scales)[:8]}")


def _scale_owner(name: str) -> str | None:
    if name.endswith("_scale_inv"):
        return name.removesuffix("_scale_inv")
    if name.endswith(".scale"):
        return name.removesuffix(".scale") + ".weight"
    return None


def _dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    try:
        if weight.dtype in FP8_DTYPES:
            return dequantize_block_fp8(weight, scale_to_float(scale), block)
        if _ROUTED_EXPERT.search(name):
            return dequantize_mxfp4(weight, scale)
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}") from None
    raise ValueError(f"{name!r} is packed {weight.dtype} (MXFP4), which only routed experts may be")


def canonical_name(name: str) -> str:
    """DeepSeek's spelling of a checkpoint name (drops `model.`, maps transformers' leftovers)."""
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}[name]
    head = _HC_HEAD.fullmatch(name)
    if head is not None:
        return f"hc_head_{head.group(1)}"
    return re.sub(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


class V4WeightLoader:
    """Routes each tensor to (a slice of) a parameter and checks every parameter is filled."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.arch = model.arch
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.params.update(model.named_buffers())
        self.filled = dict.fromkeys(self.params, 0)
        self.seen: set[str] = set()
        self.shards = ShardMap(model)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        canonical = canonical_name(name)
        if canonical in self.seen:
            raise ValueError(f"weight {name!r} appears twice in the checkpoint")
        self.seen.add(canonical)
        target = self._route(name, canonical)
        if target is None:
            return
        param_name, index = target
        for local_index, part in self.shards.named_parts(name, param_name, index, tensor):
            self._store(name, param_name, local_index, part)

    def _store(self, name: str, param_name: str, index: Any, tensor: torch.Tensor) -> None:
        param = self.params[param_name]
        region = param.data[index] if index is not None else param.data
        if tuple(region.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(region.shape)} "
                f"(check config.json against the checkpoint)"
            )
        if param_name.endswith("tid2eid"):
            if (
                tensor.is_floating_point()
                or int(tensor.min()) < 0
                or int(tensor.max()) >= self.arch.num_experts
            ):
                raise ValueError(
                    f"weight {name!r}: expert ids must be integers in 0..{self.arch.num_experts - 1}"
                )
            region.copy_(tensor)
        elif _FP32.fullmatch(param_name):
            param.data = tensor.to(param.device, torch.float32)
        else:
            region.copy_(tensor)
        self.filled[param_name] += tensor.numel()

    def _route(self, name: str, canonical: str) -> _Target | None:
        arch = self.arch
        if canonical in ("embed.weight", "norm.weight"):
            return canonical, None
        if canonical == "head.weight":
            return None if self.model.head is None else ("head", None)
        if canonical.startswith("hc_head_"):
            return f"hc_head.{canonical.removeprefix('hc_head_')}", None
        match = _LAYER.fullmatch(canonical)
        if match is None:
            raise ValueError(f"unexpected weight {name!r} for DeepSeek-V4")
        group, index, rest = match.group(1), int(match.group(2)), match.group(3)
        if group == "mtp" or index >= arch.num_layers:
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
                return self._generic(name, f"mtp.{depth}.{rest}")
            head = _HC_HEAD.fullmatch(rest)
            if head is not None:
                return f"mtp.{depth}.hc_head.{head.group(1)}", None
            return self._block(name, f"mtp.{depth}.block.", rest)
        return self._block(name, f"layers.{index}.", rest)

    def _block(self, name: str, prefix: str, rest: str) -> _Target:
        hc = _HC.fullmatch(rest)
        if hc is not None:
            return self._generic(name, f"{prefix}hc_{hc.group(1)}.{hc.group(2)}")
        expert = _EXPERT.fullmatch(rest)
        if expert is not None:
            number, kind = int(expert.group(1)), expert.group(2)
            if number >= self.arch.num_experts:
                raise ValueError(f"unexpected weight {name!r}: n_routed_experts={self.arch.num_experts}")
            if kind == "w2":
                return f"{prefix}ffn.experts.w2", number
            half = self.arch.moe_intermediate_size
            rows = slice(0, half) if kind == "w1" else slice(half, 2 * half)
            return f"{prefix}ffn.experts.w13", (number, rows)
        shared = _SHARED.fullmatch(rest)
        if shared is not None:
            kind = shared.group(1)
            if kind == "w2":
                return f"{prefix}ffn.shared_experts.down_proj", None
            half = self.arch.moe_intermediate_size
            rows = slice(0, half) if kind == "w1" else slice(half, 2 * half)
            return f"{prefix}ffn.shared_experts.gate_up_proj", rows
        return self._generic(name, prefix + rest)

    def _generic(self, name: str, target: str) -> _Target:
        """Norms keep their `.weight`; plain matrices are parameters without it."""
        for candidate in (target, target.removesuffix(".weight")):
            if candidate in self.params:
                return candidate, None
        raise ValueError(f"unexpected weight {name!r} for this DeepSeek-V4 config")

    def finish(self) -> None:
        model = self.model
        mtp = [n for n in self.params if n.startswith("mtp.")]
        if mtp and not any(self.filled[n] for n in mtp):
            log.info("no MTP weights in the checkpoint: multi-token prediction disabled")
            model.mtp = torch.nn.ModuleList()
        live = dict(model.named_parameters())
        live.update(model.named_buffers())
        incomplete = [
            f"{n} ({100 * self.filled.get(n, 0) // max(t.numel(), 1)}% loaded)"
            for n, t in live.items()
            if self.filled.get(n, 0) != t.numel()
        ]
        if incomplete:
            more = "..." if len(incomplete) > 8 else ""
            raise ValueError(f"weights missing from the checkpoint for: {incomplete[:8]}{more}")


def load_v4_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    loader = V4WeightLoader(model)
    for name, tensor in dequantized(weights, model.arch.fp8_block):
        loader.load(name, tensor)
    loader.finish()
