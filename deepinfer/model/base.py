"""What every model gives the runner: a forward over flattened tokens, logits, and its KV layout."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.kernels.gguf_blocks import PackedMatrix
from deepinfer.model.config import ModelConfig


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Per layer, each cache slot holds a tensor of `slot_shape` (e.g. (2, kv_heads, head_dim) or
    a latent vector (kv_lora_rank + rope_dim,) for MLA); a layer's cache is [num_slots, *slot_shape]."""

    num_layers: int
    slot_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        numel = 1
        for dim in self.slot_shape:
            numel *= dim
        return self.num_layers * numel * torch.tensor([], dtype=self.dtype).element_size()

    def layout(self) -> str:
        """Part of the model fingerprint: KV from another layout or dtype must never match."""
        return f"{self.num_layers}x{self.slot_shape}:{self.dtype}"


class CausalLM(torch.nn.Module):
    config: ModelConfig
    # Whether the attention of this model reads a KV cache whose dtype differs from its weights'.
    supports_kv_cache_dtype = False

    @classmethod
    def from_config(cls, config: ModelConfig) -> CausalLM:
        raise NotImplementedError

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # hidden states [T, hidden]
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        raise NotImplementedError

    def use_packed_weights(self, packed: Mapping[str, PackedMatrix]) -> set[str]:
        """quantization="gguf": replace, in place and before the model is materialized, the layers
        whose weights are among `packed` (HF names) by layers computing on the packed blocks;
        return the names taken (the loader dequantizes the others and passes them to
        load_weights)."""
        raise ValueError(f"quantization: {type(self).__name__} does not support 'gguf'")

    def quantize(self, method: str) -> None:
        """Convert the weights in place (after loading) to a quantized `method`."""
        raise ValueError(f"quantization: {type(self).__name__} does not support {method!r}")
