"""What every model gives the runner: a forward over flattened tokens, logits, and its caches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.cache_layout import CacheGroup, CacheTensor
from deepinfer.config import ConfigError, EngineConfig, ParallelConfig
from deepinfer.kernels.bf16_matmul import Bf16Kernels
from deepinfer.kernels.gguf_blocks import PackedMatrix
from deepinfer.model.config import ModelConfig
from deepinfer.model.parallel import ModelParallel


def refuse_truncation(engine: EngineConfig, why: str = "this model has no YoCo layers") -> None:
    """A model that cannot run YoCo's bounded replay refuses the option (before any weight loads)."""
    if engine.yoco_prefill_truncation != "off":
        raise ConfigError("yoco_prefill_truncation", f"{engine.yoco_prefill_truncation!r}: {why}")


def refuse_encoders(engine: EngineConfig, why: str = "this model has no vision tower") -> None:
    """A model that takes no images has nothing for an image encoder to do (before any weight loads)."""
    if engine.disaggregation.encoders:
        raise ConfigError("encoders", why)


def cache_tensor(
    name: str, slot_shape: tuple[int, ...], dtype: torch.dtype, owner: str = "target"
) -> CacheTensor:
    """A layer's cache declaration: slots of `slot_shape` in `dtype` (e.g. (2, kv_heads, head_dim)
    for K and V, or MLA's latent (kv_lora_rank + rope_dim,))."""
    return CacheTensor(name, tuple(slot_shape), str(dtype).removeprefix("torch."), dtype.itemsize, owner)


class CausalLM(torch.nn.Module):
    config: ModelConfig
    # Whether the attention of this model reads a KV cache whose dtype differs from its weights'.
    supports_kv_cache_dtype = False
    # Whether the layers attend through the engine's AttentionBackend (False: the model reads its
    # cache groups itself, and the runner gives it attention.backend.OwnAttention).
    uses_attention_backend = True
    # Whether the model has a vision tower: it then has `embed_images` and its forward takes
    # `image_embeds` / `image_mask` (the runner passes them only in a step that has images).
    accepts_images = False
    # Whether a pure-decode step's forward can be recorded as a CUDA graph (runner/graphs.py): every
    # kernel it launches reads only the static step buffers, with no host sync or shape-dependent
    # host logic (the Llama family on the Triton backend so far).
    captures_decode_graphs = False
    # Whether the rotary embedding follows ModelConfig.rope_scaling, so `--rope-scaling` can
    # replace it (the Llama family); other models place positions their own way.
    takes_rope_scaling = False
    # Whether every step of the model handles bf16 activations on the CPU (norms, rotary, the
    # attention backend's boundary), so `dtype=auto` may keep a bf16 checkpoint in bf16 there.
    cpu_bfloat16 = False

    @classmethod
    def from_config(cls, config: ModelConfig, parallel: ModelParallel | None = None) -> CausalLM:
        """The model (or, with `parallel`, this rank's shard of it) with uninitialised weights."""
        raise NotImplementedError

    @classmethod
    def from_checkpoint(
        cls, directory: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
    ) -> CausalLM | None:
        """The model with its weights, for a model that reads its HF directory itself (mapping
        its shards, keeping tensors memory-mapped); None (the default): the loader builds it
        with `from_config` and fills it through `load_weights`."""
        return None

    @classmethod
    def check_parallel(cls, config: ModelConfig, parallel: ParallelConfig) -> None:
        """Refuse, with a ConfigError naming the option, a split over ranks this model does not
        support. Rank 0 calls it before any other rank starts; everything passes by default."""

    @classmethod
    def check_engine(cls, config: ModelConfig, engine: EngineConfig) -> None:
        """Refuse, with a ConfigError naming the option, an engine feature this model does not
        run. The engine calls it before loading any weight; everything passes by default but
        DSpark, whose draft layers only DeepSeek-V4.1 has (its class checks the checkpoint), and
        YoCo's bounded replay, which only a YoCo model has, and image encoders, which only a
        model with a vision tower uses."""
        refuse_encoders(engine)
        if engine.speculative.speculative_method == "dspark":
            raise ConfigError(
                "speculative_method",
                f"'dspark' drafts with DeepSeek-V4.1's DSpark layers; {config.model_type!r} has none",
            )
        refuse_truncation(engine)

    def configure(self, engine: EngineConfig) -> None:
        """Take the engine options the forward runs by, once `check_engine` passed them; none
        by default."""

    def attention_shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) this rank's attention runs with."""
        cfg = self.config
        return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def expert_layers(self) -> list[torch.nn.Module]:
        """The expert-parallel MoE layers (ExpertParallelMoE), in layer order; none by default."""
        return []

    def cache_groups(self, dtype: torch.dtype, owner: str = "target") -> list[CacheGroup]:
        """The caches this model keeps between steps, one group per kind of block table (tagged
        with `owner`, the role the model plays in the engine); `forward` takes their tensors
        flattened in this order."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # the tensors of cache_groups(), in order
        meta: ForwardMetadata,  # one AttentionMetadata per cache group
        backend: AttentionBackend,
    ) -> torch.Tensor:  # hidden states [T, hidden]
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        raise NotImplementedError

    @property
    def rounds_activations(self) -> bool:
        """Whether some linear rounds its input or output coarsely (int8, GGUF blocks, our bf16
        kernel): a difference in the last bit of an activation can then change a rounding, and so
        a greedy token, so attention must give a row the same bits in any chunk."""
        from deepinfer.model.layers.bf16_linear import Bf16Linear
        from deepinfer.model.layers.gguf_linear import GGUFLinear
        from deepinfer.model.layers.int8_linear import Int8Linear

        return any(isinstance(m, (GGUFLinear, Int8Linear, Bf16Linear)) for m in self.modules())

    def use_packed_weights(self, packed: Mapping[str, PackedMatrix]) -> set[str]:
        """quantization="gguf": replace, in place and before the model is materialized, the layers
        whose weights are among `packed` (HF names) by layers computing on the packed blocks;
        return the names taken (the loader dequantizes the others and passes them to
        load_weights)."""
        raise ValueError(f"quantization: {type(self).__name__} does not support 'gguf'")

    def keep_fp8_weights(self) -> list[str]:
        """Before load_weights: make the layers that can compute on the checkpoint's block-scaled
        FP8 weights keep them in FP8 (layers/fp8_linear.py); return the parameters kept. None by
        default: FP8 checkpoints are dequantized at load."""
        return []

    def quantize(self, method: str) -> None:
        """Convert the weights in place (after loading) to a quantized `method`."""
        raise ValueError(f"quantization: {type(self).__name__} does not support {method!r}")

    def use_bf16_kernels(self, kernels: Bf16Kernels) -> bool:
        """Compute the bf16 projections (after loading, on the CPU) through `kernels`, replacing
        the layers that run them; whether the model did. False by default: torch's GEMMs stay."""
        return False
