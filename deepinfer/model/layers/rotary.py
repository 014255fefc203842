"""Rotary position embeddings (HF "rotate half" layout) with default, linear, llama3 and YaRN scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from deepinfer.kernels.rowwise import rowwise_kernels


def _yarn_find_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(dim: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin magnitude factor implied by the scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default" or scaling is None:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        old_ctx = int(scaling["original_max_position_embeddings"])
        beta_fast = float(scaling.get("beta_fast", 32))
        beta_slow = float(scaling.get("beta_slow", 1))
        low = max(math.floor(_yarn_find_dim(beta_fast, dim, base, old_ctx)), 0)
        high = min(math.ceil(_yarn_find_dim(beta_slow, dim, base, old_ctx)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        mscale = scaling.get("mscale", 1.0)
        mscale_all_dim = scaling.get("mscale_all_dim", 0.0)
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        return inv, float(attention_factor)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables are built lazily on first use, so models can be created on the meta device."""

    def __init__(self, dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.dim, self.max_positions, self.base, self.scaling = dim, max_positions, base, scaling
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # Set by model/layers/device_kernels.py when the engine runs on the Triton backend; the
        # kernels are imported on use because Triton is an optional dependency.
        self.on_triton = False

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device or self._tables[0].dtype != dtype:
            inv_freq, magnitude = inv_frequencies(self.dim, self.base, self.scaling)
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq)  # [P, dim/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [P, dim]
            self._tables = (
                (emb.cos() * magnitude).to(device, dtype),
                (emb.sin() * magnitude).to(device, dtype),
            )
        return self._tables

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # positions: [T]; each x: [T, heads, dim]
        cos_table, sin_table = self.tables(xs[0].device, xs[0].dtype)
        cos = cos_table[positions].unsqueeze(1)  # [T, 1, dim]
        sin = sin_table[positions].unsqueeze(1)
        return tuple(x * cos + _rotate_half(x) * sin for x in xs)

    def apply_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotate x [T, heads, dim] in place (q and k heads can be passed as one view)."""
        if self.on_triton and x.shape[-1] == self.dim and x.stride(2) == 1:
            from deepinfer.kernels.triton.rotary import rotary_

            rotary_(x, positions, *self.tables(x.device, x.dtype))
            return
        kernels = rowwise_kernels()
        if kernels is not None and x.dtype is torch.bfloat16 and x.is_cpu:
            # bf16 rows rotate in fp32 through the kernel, rounded once on the way back: fewer
            # roundings than the eight bf16 ops below (HF's three), and ~3x faster at a decode step.
            wide = x.float()
            self.apply_(positions, wide)
            x.copy_(wide)
            return
        cos_table, sin_table = self.tables(x.device, x.dtype)
        if (
            kernels is not None
            and x.dtype is torch.float32
            and x.is_cpu
            and x.shape[-1] == self.dim
            and x.stride(2) == 1
            and x.stride(1) == self.dim
            and positions.dtype is torch.int64
            and positions.is_contiguous()
        ):
            kernels.rotary_(x, positions, cos_table, sin_table)  # one C call instead of ~8 ops
            return
        half = self.dim // 2
        cos = cos_table[positions, :half].unsqueeze(1)  # [T, 1, dim/2]
        sin = sin_table[positions, :half].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        rotated_1 = x1 * cos - x2 * sin
        x2.mul_(cos).addcmul_(x1, sin)
        x1.copy_(rotated_1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
