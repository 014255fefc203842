"""DeepSeek-V4.1's vision encoder: images -> the embeddings of their tokens in the LM's prompt.

V4.1 does not tile: an image is resized (by the preprocessing) to one canvas of rows x cols
patches of 14 pixels. The ViT (`layers/vision_vit.py`) gives a feature per patch, the projector
(`layers/vision_projector.py`) merges d x d patches into one LM-width token, and each image
becomes this run of embeddings, R x C the merged grid (each side divided by d, rounded up):

    image_start, then R times (C image tokens, image_newline), then image_end

R * (C + 1) + 2 tokens (`image_token_count`), the layout of DeepSeek's processor; the newline
keeps the rows apart for the LM, whose RoPE is 1-D. The three special embeddings are the LM
checkpoint's `image_start`, `image_newline`, `image_end`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch, VisionSpec
from deepinfer.model.deepseek_v4.v41_weights import V41Weights
from deepinfer.model.deepseek_v4.vision_projector import VisionProjector, merged_grid
from deepinfer.model.deepseek_v4.vision_vit import PatchGrid, VisionTransformer, patchify

SPECIAL_EMBEDDINGS = ("image_start", "image_newline", "image_end")
# The merge ratio the preprocessing counts an image's tokens for (recipe/images/geometry.py's
# MERGE, DeepSeek's processor's): a tower merging otherwise cannot take the prompts it writes.
PREPROCESSED_MERGE = 3


def image_token_count(grid: PatchGrid, ratio: int) -> int:
    """LM tokens of one image of rows x cols patches: merged rows x (merged cols + newline) + 2."""
    merged = merged_grid(grid, ratio)
    return merged.rows * (merged.cols + 1) + 2


class VisionEncoderV41(torch.nn.Module):
    """State-dict names are the checkpoint's (`vision.*`, `aligner.*`, `image_*`)."""

    def __init__(self, spec: VisionSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.vision = VisionTransformer(
            spec.hidden_size, spec.patch_size, spec.num_layers, spec.num_heads, spec.intermediate_size
        )
        self.aligner = VisionProjector(spec.hidden_size, spec.downsample_ratio, hidden_size)
        for name in SPECIAL_EMBEDDINGS:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(hidden_size)))

    @classmethod
    def from_weights(cls, arch: DeepseekV41Arch, weights: V41Weights) -> VisionEncoderV41:
        """From load_v41_weights' float32 tensors, which has checked every name and shape."""
        if not weights.vision:
            raise ValueError("the checkpoint has no vision tower (no vision.* / aligner.* tensors)")
        return cls.from_state(
            arch, dict(weights.vision) | {n: weights.tensors[n] for n in SPECIAL_EMBEDDINGS}
        )

    @classmethod
    def from_state(cls, arch: DeepseekV41Arch, state: dict[str, torch.Tensor]) -> VisionEncoderV41:
        """From the tower's float32 tensors and the special embeddings (load_v41_vision's)."""
        with torch.device("meta"):  # no throwaway initialisation of the full-size tower
            encoder = cls(arch.vision, arch.hidden_size)
        encoder.load_state_dict(state, strict=True, assign=True)
        return encoder.requires_grad_(False)

    def forward(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Normalised images [3, H, W] (H, W multiples of the patch size) -> their token
        embeddings [sum of image_token_count, hidden_size], image after image."""
        pieces = [patchify(image, self.spec.patch_size) for image in images]
        return self.embed_patches(torch.cat([p for p, _ in pieces]), [grid for _, grid in pieces])

    def embed_patches(self, patches: torch.Tensor, grids: Sequence[PatchGrid]) -> torch.Tensor:
        """patches [P, 3, p, p], each image's grid in scanline order, images end to end (the
        layout of DeepSeek's rgb_pad_to_patches) -> [sum of image_token_count, hidden_size]."""
        features = self.vision(patches, grids)
        out = []
        for image, grid in zip(features.split([g.patches for g in grids]), grids, strict=True):
            out.append(self._layout(self.aligner(image, grid), merged_grid(grid, self.spec.downsample_ratio)))
        return torch.cat(out)

    def _layout(self, tokens: torch.Tensor, merged: PatchGrid) -> torch.Tensor:
        """tokens [R * C, hidden] -> [R * (C + 1) + 2, hidden]: start, rows each ending in a newline, end."""
        rows = tokens.reshape(merged.rows, merged.cols, -1)
        newlines = self.image_newline.expand(merged.rows, 1, -1)
        body = torch.cat([rows, newlines], dim=1).flatten(0, 1)
        return torch.cat([self.image_start.unsqueeze(0), body, self.image_end.unsqueeze(0)])
