"""Source adapter for quantized checkpoints: each quantized weight paired with its scale tensor and
dequantized to float32 on the way to the weight loader.

A `ScaledFormat` says which tensors are scales (and whose), which dtypes are quantized and how a
weight and its scale become float32; `dequantized` does the pairing for every format. DeepSeek-V3's
block FP8 (`X.weight` + `X.weight_scale_inv`) is `block_fp8`; DeepSeek-V4 adds `X.scale` spellings,
e8m0 scales and MXFP4 experts (deepseek_v4/weights.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from deepinfer.model.layers.fp8 import FP8_DTYPES, SCALE_SUFFIX, dequantize_block_fp8


@dataclass(slots=True, frozen=True)
class ScaledFormat:
    """How a checkpoint stores its quantized weights. The messages are format strings: `name` and
    `dtype` (a scale on an unquantized tensor), `names` (weights left without their scale),
    `scales` and `owners` (scales left without their weight: their names, their weights' names)."""

    scale_owner: Callable[[str], str | None]  # the weight a tensor is the scale of; None: not a scale
    quantized: tuple[torch.dtype, ...]  # dtypes stored with a scale
    dequantize: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]  # (name, weight, scale) -> float32
    scale_on_unquantized: str
    weights_without_scale: str
    scales_without_weight: str


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]],
    fmt: ScaledFormat,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass unquantized tensors through; pair each quantized weight with its scale (in either
    order) and yield the float32 weight under the weight's name, or, for a weight `keep` names
    (a layer computing on it quantized), the weight and then its scale as stored.

    Only unpaired halves are held back, and a checkpoint stores a weight and its scale close
    together, so this buffers little. Anything left unpaired at the end is an error.
    """
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, tuple[str, torch.Tensor]] = {}  # owner -> (scale name, scale)

    def paired(
        name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if keep is not None and keep(name):
            yield name, weight
            yield scale_name, scale
        else:
            yield name, fmt.dequantize(name, weight, scale)

    for name, tensor in weights:
        owner = fmt.scale_owner(name)
        if owner is not None:
            weight = pending_weights.pop(owner, None)
            if weight is None:
                pending_scales[owner] = (name, tensor)
            else:
                yield from paired(owner, weight, name, tensor)
        elif tensor.dtype in fmt.quantized:
            pending = pending_scales.pop(name, None)
            if pending is None:
                pending_weights[name] = tensor
            else:
                yield from paired(name, tensor, *pending)
        else:
            if name in pending_scales:
                raise ValueError(fmt.scale_on_unquantized.format(name=repr(name), dtype=tensor.dtype))
            yield name, tensor
    if pending_weights:
        raise ValueError(fmt.weights_without_scale.format(names=sorted(pending_weights)[:8]))
    if pending_scales:
        scales = sorted(scale for scale, _ in pending_scales.values())
        raise ValueError(
            fmt.scales_without_weight.format(scales=scales[:8], owners=sorted(pending_scales)[:8])
        )


def _fp8_scale_owner(name: str) -> str | None:
    return name.removesuffix(SCALE_SUFFIX) if name.endswith(SCALE_SUFFIX) else None


def block_fp8(block: tuple[int, int] = (128, 128)) -> ScaledFormat:
    """DeepSeek-V3's FP8: `X.weight` in float8 with one float32 scale per `block` tile in
    `X.weight_scale_inv`."""
    return ScaledFormat(
        scale_owner=_fp8_scale_owner,
        quantized=FP8_DTYPES,
        dequantize=lambda name, weight, scale: dequantize_block_fp8(weight, scale, block),
        scale_on_unquantized=f"{{name}} has a {SCALE_SUFFIX} scale but is stored as {{dtype}}, not FP8",
        weights_without_scale=f"FP8 weights without a {SCALE_SUFFIX} scale: {{names}}",
        scales_without_weight="FP8 scales without their weight: {scales}",
    )


def dequantize_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int] = (128, 128),
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with DeepSeek-V3's block FP8 weights dequantized (see `block_fp8`), but those
    `keep` names, which pass with their scales."""
    return dequantized(weights, block_fp8(block), keep)
