"""DeepSeek-V4.1's vision projector (`downsample_mlp_gelu`): ViT features -> LM-width tokens.

Each image's rows x cols patch features are zero-padded at the bottom and right to multiples of
d (the downsample ratio); every d x d block becomes one vector of width x d x d, channel-major
then the block's rows and columns (torch's unfold order), blocks in scanline order. Two linears
with biases and an exact (erf) GELU between them (`aligner.w1`, `aligner.w2`) bring it to the
LM's hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.vision_vit import PatchGrid


def merged_grid(grid: PatchGrid, ratio: int) -> PatchGrid:
    """The LM tokens' grid: each side divided by the ratio, rounded up."""
    return PatchGrid(-(-grid.rows // ratio), -(-grid.cols // ratio))


def merge_patches(features: torch.Tensor, grid: PatchGrid, ratio: int) -> torch.Tensor:
    """One image's features [rows * cols, width] -> [merged rows * merged cols, width * ratio^2]."""
    merged = merged_grid(grid, ratio)
    x = features.reshape(grid.rows, grid.cols, -1)
    x = F.pad(x, (0, 0, 0, merged.cols * ratio - grid.cols, 0, merged.rows * ratio - grid.rows))
    x = x.reshape(merged.rows, ratio, merged.cols, ratio, -1).permute(0, 2, 4, 1, 3)  # [R, C, width, d, d]
    return x.reshape(merged.patches, -1)


class VisionProjector(torch.nn.Module):
    """Parameter names are the checkpoint's under `aligner.`."""

    def __init__(self, vision_width: int, ratio: int, hidden_size: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.w1 = torch.nn.Linear(vision_width * ratio * ratio, hidden_size)
        self.w2 = torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, features: torch.Tensor, grid: PatchGrid) -> torch.Tensor:
        """One image's ViT features [rows * cols, width] -> [merged patches, hidden_size]."""
        return self.w2(F.gelu(self.w1(merge_patches(features, grid, self.ratio))))
