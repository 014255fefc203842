"""DeepSeek-V4's RoPE: interleaved pairs on the trailing channels of each head, angles in float32.

Each head is laid out [nope | rope]; the last `dim` channels rotate as pairs (x0, x1), (x2, x3), ...
Sliding-window layers use plain RoPE; compressed layers, their compressors and the indexer use
another base with YaRN frequency interpolation (no magnitude correction: DeepSeek applies none).
The inverse rotation (`inverse=True`) turns the attention output's rope channels back: with K = V,
every value carries its key's rotation, and rotating the output by -position leaves each entry's
contribution a function of its distance to the query only.
"""

from __future__ import annotations

import math

import torch

from deepinfer.model.deepseek_v4.config import RopeSpec


def inverse_frequencies(dim: int, spec: RopeSpec) -> torch.Tensor:
    """[dim / 2] float32; YaRN blends interpolated and extrapolated frequencies with a linear ramp."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base_freqs = spec.theta**exponents
    extrapolated = 1.0 / base_freqs
    if spec.yarn is None:
        return extrapolated
    yarn = spec.yarn
    interpolated = 1.0 / (yarn["factor"] * base_freqs)
    old_context = yarn["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_share = 1 - ramp
    return interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share


class TrailingRope(torch.nn.Module):
    """Rotates the last `dim` channels of [..., channels] tensors by the angles of given positions."""

    def __init__(self, dim: int, spec: RopeSpec) -> None:
        super().__init__()
        self.dim = dim
        self.spec = spec
        self._inv_freq: torch.Tensor | None = None  # built on first use (models are created on meta)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (cos, sin), each [N, dim / 2] float32."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = inverse_frequencies(self.dim, self.spec).to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self._inv_freq
        scale = self.spec.yarn["attention_factor"] if self.spec.yarn else 1.0
        return freqs.cos() * scale, freqs.sin() * scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [N, ..., C] (one position per leading row), positions [N] -> x with its tail rotated."""
        cos, sin = self.angles(positions)
        return rotate_tail(x, cos, sin, inverse)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [N, ..., C]; cos/sin [N, d/2] broadcast over the middle dims; the last d channels rotate."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    rope_dim = 2 * cos.shape[-1]
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))  # [..., d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)
