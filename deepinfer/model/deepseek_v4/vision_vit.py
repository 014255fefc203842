"""DeepSeek-V4.1's vision transformer: patches of one or more images -> one feature per patch.

An image reaches it as a grid of rows x cols patches of 3 x p x p normalised pixels, in scanline
order (row by row, left to right), several images end to end. Each patch is flattened (channel,
then pixel row, then pixel column) and projected (`patch_embed.proj`, with bias). Then pre-norm
blocks: RMSNorm, attention with 2-D RoPE, residual; RMSNorm, SwiGLU, residual; a final RMSNorm.
All RMSNorms have eps 1e-6.

Attention is bidirectional and never crosses images. Its one linear (`attn.wqkv`, with bias)
gives q, k and v, heads of head_dim channels each. 2-D RoPE (theta 10000) rotates channel i with
channel i + head_dim / 2 (the half-split pairing), i < head_dim / 2: the first head_dim / 4
pairs by the patch's row, the next head_dim / 4 by its column, pair j of each group by angle
position * theta^(-4j / head_dim). Positions restart at (0, 0) in every image.

The SwiGLU's `mlp.w1` projects to 2 x intermediate channels, gate first: silu(gate) * up, then
`mlp.w2` (neither with bias).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.norm import Fp32RMSNorm

NORM_EPS = 1e-6
ROPE_THETA = 10000.0


class PatchGrid(NamedTuple):
    """An image's patches: rows x cols. (DeepSeek's `images_spatial_crop` holds (cols, rows).)"""

    rows: int
    cols: int

    @property
    def patches(self) -> int:
        return self.rows * self.cols


def patchify(image: torch.Tensor, patch: int) -> tuple[torch.Tensor, PatchGrid]:
    """image [3, H, W], H and W multiples of `patch` -> patches [rows * cols, 3, patch, patch]."""
    channels, height, width = image.shape
    if channels != 3 or height % patch or width % patch:
        raise ValueError(f"an image is [3, H, W] with H and W multiples of {patch}, got {list(image.shape)}")
    grid = PatchGrid(height // patch, width // patch)
    patches = image.reshape(3, grid.rows, patch, grid.cols, patch).permute(1, 3, 0, 2, 4)
    return patches.reshape(grid.patches, 3, patch, patch), grid


def patch_positions(grid: PatchGrid) -> torch.Tensor:
    """[rows * cols, 2] (row, col) of each patch in scanline order."""
    rows = torch.arange(grid.rows).repeat_interleave(grid.cols)
    cols = torch.arange(grid.cols).repeat(grid.rows)
    return torch.stack([rows, cols], dim=-1)


def rope_2d(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n, 2] (row, col) -> cos, sin [n, head_dim / 2]: row angles, then column angles."""
    quarter = head_dim // 4
    inv_freq = ROPE_THETA ** (-torch.arange(quarter, dtype=torch.float64) * 4 / head_dim)  # [quarter]
    angles = (positions.double().unsqueeze(-1) * inv_freq).flatten(1)  # [n, 2 * quarter]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]; cos, sin [n, head_dim / 2]; channel i pairs with i + head_dim / 2."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class VisionAttention(torch.nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.wqkv = torch.nn.Linear(width, 3 * width)
        self.wo = torch.nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """x [n, width] of images of `lengths` patches end to end -> [n, width]."""
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)  # [n, heads, head_dim] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # One image at a time: no patch attends to another image's. A batch axis of 1 ([1, heads,
        # n, head_dim]): given 3-D tensors the CPU takes SDPA's plain math path, which materialises
        # every head's n x n scores (16 x 8,748^2 fp32 = 4.9 GB for a 1,024-token image); 4-D
        # takes the fused kernel (16 heads of 64 at 4,000 patches, one thread: 5.6 s -> 1.5 s).
        out = [
            F.scaled_dot_product_attention(
                qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            )[0].transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        return self.wo(torch.cat(out).flatten(1))


class VisionSwiGLU(torch.nn.Module):
    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(width, 2 * intermediate, bias=False)
        self.w2 = torch.nn.Linear(intermediate, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(torch.nn.Module):
    def __init__(self, width: int, num_heads: int, intermediate: int) -> None:
        super().__init__()
        self.norm1 = Fp32RMSNorm(width, NORM_EPS)
        self.attn = VisionAttention(width, num_heads)
        self.norm2 = Fp32RMSNorm(width, NORM_EPS)
        self.mlp = VisionSwiGLU(width, intermediate)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(torch.nn.Module):
    """Parameter names are the checkpoint's under `vision.`."""

    def __init__(self, width: int, patch: int, num_layers: int, num_heads: int, intermediate: int) -> None:
        super().__init__()
        self.patch, self.head_dim = patch, width // num_heads
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Linear(3 * patch * patch, width)
        self.blocks = torch.nn.ModuleList(
            VisionBlock(width, num_heads, intermediate) for _ in range(num_layers)
        )
        self.norm = Fp32RMSNorm(width, NORM_EPS)

    def forward(self, patches: torch.Tensor, grids: Sequence[PatchGrid]) -> torch.Tensor:
        """patches [P, 3, p, p] of the images' grids end to end -> features [P, width]."""
        lengths = [grid.patches for grid in grids]
        if patches.shape[1:] != (3, self.patch, self.patch) or patches.shape[0] != sum(lengths):
            raise ValueError(
                f"patches {list(patches.shape)} do not match {sum(lengths)} patches of [3, {self.patch}, "
                f"{self.patch}] for the grids {list(grids)}"
            )
        # One image at a time through every layer, from a fresh (aligned) copy of its patches: the
        # dense products go through the BLAS, whose blocking, and so the last bits of each row,
        # depends on the row count, the data's alignment and the CPU (a batch of two images
        # differed from each alone on an Intel Xeon). An image's features are thus the same bits
        # whatever images share its batch; attention was per image already.
        return torch.cat(
            [self._image(p.clone(), g) for p, g in zip(patches.split(lengths), grids, strict=True)]
        )

    def _image(self, patches: torch.Tensor, grid: PatchGrid) -> torch.Tensor:
        """One image's patches [P, 3, p, p] -> features [P, width]."""
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(patches.reshape(patches.shape[0], -1).to(weight.dtype))
        cos, sin = rope_2d(patch_positions(grid), self.head_dim)
        for block in self.blocks:
            x = block(x, cos, sin, [grid.patches])
        return self.norm(x)
