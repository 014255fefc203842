"""A model's architecture, normalized from a HF config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer.config.rope import scaled_context
from deepinfer.families import family_for_model_type


@dataclass(slots=True)
class ModelConfig:
    model_type: str  # registry key: "llama", "qwen2", "qwen3", "deepseek_v3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # Per layer, the sliding window of its attention (None: full attention).
    layer_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)  # the full source config, for model-specific keys

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        raw = cfg
        if "num_attention_heads" not in cfg and isinstance(cfg.get("text_config"), dict):
            # A multimodal wrapper (DeepSeek-V4.1): the language model's fields are in text_config,
            # the special tokens at the top.
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k.endswith("token_id")}}
            cfg["model_type"] = raw.get("model_type", cfg.get("model_type"))
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers >= 5 folds theta and scaling together
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
        eos = cfg.get("eos_token_id")
        num_layers = cfg["num_hidden_layers"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 4 * hidden),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            layer_windows=_layer_windows(cfg, model_type, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            raw=dict(raw),
        )

    def scale_rope(self, scaling: Mapping[str, Any]) -> None:
        """Take a RoPE scaling given to the engine (`--rope-scaling`, checked by the config) in
        place of the checkpoint's: the rotary tables and the context grow to factor x the original
        length (the scaling's `original_max_position_embeddings`, else this checkpoint's)."""
        scaling = {"original_max_position_embeddings": self.max_position_embeddings, **scaling}
        self.rope_scaling = scaling
        self.max_position_embeddings = scaled_context(self.max_position_embeddings, scaling)


def _layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> list[int | None]:
    """HF's sliding-window settings (unless the model family reads its own): `layer_types` where
    given; Qwen2's `use_sliding_window` for layers from `max_window_layers` on; Mistral's
    `sliding_window` on every layer."""
    family = family_for_model_type(model_type)
    if family is not None and family.own_layer_types:
        return [None] * num_layers  # hybrid layer types, read by the family's own config module
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"config.json: layer_types {sorted(unknown)} are not supported")
        if "sliding_attention" in types and not window:
            raise ValueError("config.json: sliding_attention layers need a sliding_window")
        return [window if kind == "sliding_attention" else None for kind in types]
    if model_type == "qwen2" and cfg.get("use_sliding_window") and window:
        first = cfg.get("max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    if model_type == "mistral" and window:
        return [window] * num_layers
    return [None] * num_layers
