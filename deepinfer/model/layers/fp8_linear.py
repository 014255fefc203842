"""A linear whose block-scaled FP8 weight stays in FP8 (kernels/triton/fp8_gemm.py), where the
device computes on it; elsewhere FP8 checkpoints are dequantized at load (layers/fp8.py).

A model keeps a weight in FP8 by `keep_block_fp8`: before loading, its plain weight parameter
becomes an Fp8BlockLinear (weight and scale then load as checkpoint tensors), and its forward
applies either through `linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.config import ConfigError
from deepinfer.kernels.triton import interpreting, triton_installed
from deepinfer.model.layers.parallel_linear import Segment

# Compute capability from which a CUDA device has FP8 tensor cores (Ada 8.9, Hopper 9.0, ...).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_weights_kept(device: torch.device) -> bool:
    """Whether block-scaled FP8 weights stay in FP8 on `device`: CUDA of compute capability >= 8.9,
    with Triton. The CPU and older GPUs keep dequantizing them."""
    if device.type != "cuda" or not triton_installed():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def keeps_fp8_weights(choice: str, triton_backend: bool, device: torch.device) -> bool:
    """The engine's `fp8_weights` option resolved: whether FP8 checkpoints keep their weights in
    FP8. auto: on the Triton backend where the device computes on FP8 (`fp8_weights_kept`);
    keep: there, or on the CPU under TRITON_INTERPRET=1 (the kernel interpreted: for tests);
    dequantize: never. Raises ConfigError for a `keep` nothing here can run."""
    if choice == "dequantize":
        return False
    if choice == "auto":
        return triton_backend and fp8_weights_kept(device)
    if not triton_backend:
        raise ConfigError(
            "fp8_weights", "keep runs its FP8 linears in Triton: it needs attention_backend=triton"
        )
    if device.type == "cpu":
        if not (triton_installed() and interpreting()):
            raise ConfigError(
                "fp8_weights", "keep on the CPU needs Triton's interpreter (TRITON_INTERPRET=1)"
            )
        return True
    if not fp8_weights_kept(device):
        raise ConfigError(
            "fp8_weights", f"keep needs a CUDA device of compute capability >= 8.9 with Triton, not {device}"
        )
    return True


class Fp8BlockLinear(torch.nn.Module):
    """y = x @ (weight * scale)^T + bias, the weight float8_e4m3fn [N, K] with one float32 scale
    per `block` tile ([ceil(N/bn), ceil(K/bk)]); y in x's dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        block: tuple[int, int] = (128, 128),
    ) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"an FP8 block linear takes a float8_e4m3fn weight, got {weight.dtype}")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.scale = torch.nn.Parameter(scale.float(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.block = block

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.kernels.triton.fp8_gemm import fp8_block_linear

        out = fp8_block_linear(x.reshape(-1, x.shape[-1]), self.weight, self.scale, self.block)
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8BlockLinear) -> torch.Tensor:
    """x @ weight^T for a plain weight or one kept in FP8."""
    return weight(x) if isinstance(weight, Fp8BlockLinear) else F.linear(x, weight)


def keep_block_fp8(module: torch.nn.Module, param: str, block: tuple[int, int]) -> bool:
    """Replace `module`'s plain weight parameter `param` [N, K] by an Fp8BlockLinear of the same
    shape on the same device (its weight and scale uninitialised, for the loader), when every
    block tile of it holds rows of one checkpoint tensor: not split over ranks, and each fused
    segment but the last a whole number of tiles (else one scale would have to cover rows of
    two tensors with two scales). Returns whether it was replaced."""
    weight = getattr(module, param)
    splits: dict[str, tuple[int, list[Segment]]] = getattr(module, "splits", {})
    dim, segments = splits.get(param, (0, [Segment.whole(weight.shape[0])]))
    if any(s.local != s.size for s in segments):
        return False
    if dim == 0 and any(s.size % block[0] for s in segments[:-1]):
        return False
    rows, cols = weight.shape
    scale_rows = [-(-s.size // block[0]) for s in segments] if dim == 0 else [-(-rows // block[0])]
    kept = Fp8BlockLinear(
        torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=weight.device),
        torch.empty(sum(scale_rows), -(-cols // block[1]), device=weight.device),
        block=block,
    )
    if dim == 0 and len(segments) > 1:  # the fused segments, in weight rows and in scale rows
        kept.splits = {"weight": (0, segments), "scale": (0, [Segment.whole(n) for n in scale_rows])}
    splits.pop(param, None)
    delattr(module, param)
    setattr(module, param, kept)
    return True
