"""The encoder's model: the V4.1 vision tower alone, with an encoder-output cache by content hash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from deepinfer.config import ConfigError
from deepinfer.families import family_for_model_type
from deepinfer.image_input import ImageInput, embeddings_layout
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_weights import load_v41_vision
from deepinfer.model.deepseek_v4.vision import PREPROCESSED_MERGE, VisionEncoderV41
from deepinfer.model.deepseek_v4.vision_vit import PatchGrid
from deepinfer.runner.image_embeds import ImageEmbeddings


def read_config(directory: Path) -> dict:
    """config.json of a V4.1 checkpoint whose tower takes the preprocessing's images; a
    ConfigError naming `model` otherwise (before any weight is read)."""
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(
            "model",
            f"an encode-role server needs a DeepSeek-V4.1 HF directory; {directory} has no config.json",
        )
    raw = json.loads(path.read_text())
    family = family_for_model_type(raw.get("model_type"))
    # Only a family whose record names a vision tower has one (of the built-in ones, V4.1).
    if family is None or family.vision_tower is None or "vision_config" not in raw:
        raise ConfigError("model", f"{directory} is not a DeepSeek-V4.1 checkpoint with a vision tower")
    arch = DeepseekV41Arch.from_raw(raw)
    if arch.vision.downsample_ratio != PREPROCESSED_MERGE:
        raise ConfigError("model", "its tower does not merge 3 x 3 patches: it takes no images")
    return raw


class VisionTower:
    """Encodes preprocessed images (one caller at a time: the service runs it on one thread)."""

    def __init__(self, directory: Path, num_threads: int | None) -> None:
        raw = read_config(directory)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        arch = DeepseekV41Arch.from_raw(raw)
        self.encoder = VisionEncoderV41.from_state(arch, load_v41_vision(directory, arch))
        self.layout = embeddings_layout(raw)
        self.cache = ImageEmbeddings(self._embed)

    def _embed(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        with torch.inference_mode():
            return self.encoder.embed_patches(patches, [PatchGrid(rows, cols) for rows, cols in grids])

    @property
    def num_encoded(self) -> int:
        return self.cache.num_encoded

    def embeddings(self, images: list[ImageInput]) -> list[np.ndarray]:
        """Each image's embeddings as bytes (uint8 view of float32 [num_tokens, hidden]); those
        not in the cache go through the tower together."""
        return [embeds.numpy().reshape(-1).view(np.uint8) for embeds in self.cache.of(images)]
