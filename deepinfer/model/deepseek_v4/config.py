"""DeepSeek-V4's config.json, validated and normalized.

Two dialects reach us and mean the same model:
- DeepSeek's published one: `compress_ratios` (one int per layer, 0 / 4 / 128, plus one per MTP
  module), `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` ({"type": "yarn", ...});
- transformers' (what `save_pretrained` writes): `layer_types`, `compress_rates`,
  `mlp_layer_types`, `partial_rotary_factor` and `rope_parameters` split into "main" and
  "compress".
Both are folded the way transformers' DeepseekV4Config folds them: sliding-window layers use plain
RoPE with `rope_theta`; the compressed layers (and their compressors and indexer) use
`compress_rope_theta` with the YaRN scaling and no YaRN magnitude correction
(attention_factor 1).

Every rejected config names the key at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.model.config import ModelConfig
from deepinfer.model.layers.fp8 import weight_block_size

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_TYPES = (HASH_MOE, MOE)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
EXPERT_DTYPES = (None, "bf16", "fp8", "fp4")


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """One RoPE family: base, and YaRN parameters (None: plain RoPE)."""

    theta: float
    yarn: dict[str, Any] | None  # factor, original_max_position_embeddings, beta_fast, beta_slow, truncate


@dataclass(slots=True, frozen=True)
class DeepseekV4Arch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int  # trailing channels of every head that carry RoPE
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]  # CSA and HCA rates: source tokens per compressed entry
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: RopeSpec
    compress_rope: RopeSpec
    num_mtp_layers: int
    tie_word_embeddings: bool
    fp8_block: tuple[int, int]
    expert_dtype: str | None

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> DeepseekV4Arch:
        return cls.from_raw(cfg.raw)

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> DeepseekV4Arch:
        num_layers = _int(raw, "num_hidden_layers")
        num_mtp = _int(raw, "num_nextn_predict_layers", 0)
        _check_fixed(raw)
        head_dim = _int(raw, "head_dim")
        layer_types, rates = _layer_types(raw, num_layers, num_mtp)
        rope_head_dim = _rope_head_dim(raw, head_dim)
        main_rope, compress_rope = _ropes(raw, rope_head_dim)
        num_heads = _int(raw, "num_attention_heads")
        o_groups = _int(raw, "o_groups")
        if num_heads % o_groups:
            raise ValueError(f"config.json: o_groups={o_groups} must divide num_attention_heads={num_heads}")
        num_experts = _int(raw, "n_routed_experts")
        top_k = _int(raw, "num_experts_per_tok")
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok={top_k} must be in 1..n_routed_experts={num_experts}"
            )
        scoring = raw.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"config.json: scoring_func={scoring!r} is not one of {SCORING_FUNCS}")
        arch = cls(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=_int(raw, "hidden_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            rope_head_dim=rope_head_dim,
            q_lora_rank=_int(raw, "q_lora_rank"),
            o_groups=o_groups,
            o_lora_rank=_int(raw, "o_lora_rank"),
            sliding_window=_int(raw, "sliding_window"),
            layer_types=layer_types,
            compress_rates=rates,
            index_n_heads=_int(raw, "index_n_heads"),
            index_head_dim=_int(raw, "index_head_dim"),
            index_topk=_int(raw, "index_topk"),
            hc_mult=_int(raw, "hc_mult"),
            hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters", 20),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            mlp_layer_types=_mlp_layer_types(raw, num_layers),
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=_int(raw, "moe_intermediate_size"),
            scoring_func=scoring,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            num_mtp_layers=num_mtp,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            fp8_block=_fp8_block(raw),
            expert_dtype=_expert_dtype(raw),
        )
        for key in (
            "head_dim",
            "hidden_size",
            "q_lora_rank",
            "o_lora_rank",
            "sliding_window",
            "index_head_dim",
        ):
            if getattr(arch, key) <= 0:
                raise ValueError(f"config.json: {key} must be positive, got {getattr(arch, key)}")
        for key in ("index_n_heads", "index_topk", "hc_mult", "hc_sinkhorn_iters", "moe_intermediate_size"):
            if getattr(arch, key) <= 0:
                raise ValueError(f"config.json: {key} must be positive, got {getattr(arch, key)}")
        if arch.index_head_dim < rope_head_dim:
            raise ValueError(
                f"config.json: index_head_dim={arch.index_head_dim} is smaller than the rope dimension "
                f"{rope_head_dim} applied to it"
            )
        return arch

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of `layer`; 0 for sliding-window-only layers."""
        kind = self.layer_type(layer)
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def layer_type(self, layer: int) -> str:
        """Attention type of a main layer, or SLIDING for an MTP module's block (layer >= num_layers)."""
        return self.layer_types[layer] if layer < self.num_layers else SLIDING

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_layers and self.mlp_layer_types[layer] == HASH_MOE


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"config.json: {key!r} is required for DeepSeek-V4")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json: {key!r} must be an integer, got {value!r}")
    return value


def _check_fixed(raw: dict[str, Any]) -> None:
    """Settings every V4 checkpoint has and the architecture assumes."""
    fixed = {
        "num_key_value_heads": 1,  # one shared K=V head
        "hidden_act": "silu",
        "attention_bias": False,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
    }
    for key, expected in fixed.items():
        if key in raw and raw[key] != expected:
            raise ValueError(
                f"config.json: {key}={raw[key]!r} is not supported (DeepSeek-V4 uses {expected!r})"
            )


def _layer_types(
    raw: dict[str, Any], num_layers: int, num_mtp: int
) -> tuple[tuple[str, ...], dict[str, int]]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    given = raw.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict) or set(given) - {CSA, HCA}:
            raise ValueError(f"config.json: compress_rates must map {CSA!r} / {HCA!r} to ints, got {given!r}")
        rates.update(given)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(legacy) is not None:
            rates[kind] = raw[legacy]
    for kind, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ValueError(f"config.json: compress_rates[{kind!r}]={rate!r} must be a positive integer")
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < num_layers:
            raise ValueError(
                f"config.json: compress_ratios must list at least num_hidden_layers={num_layers} entries"
            )
        bad = [r for r in ratios if r not in _RATIO_TO_TYPE]
        if bad:
            raise ValueError(f"config.json: compress_ratios entries must be 0, 4 or 128, got {bad}")
        mtp_ratios = ratios[num_layers : num_layers + num_mtp]
        if any(mtp_ratios):
            raise ValueError(
                f"config.json: compress_ratios for the MTP modules must be 0 (sliding window), got {mtp_ratios}"
            )
        types = [_RATIO_TO_TYPE[r] for r in ratios[:num_layers]]
    if types is None:
        # transformers' default schedule (V4-Pro's): two HCA layers, then HCA / CSA alternating.
        types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"config.json: layer_types must list num_hidden_layers={num_layers} entries")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"config.json: layer_types entries must be one of {LAYER_TYPES}, got {bad}")
    return tuple(types), rates


def _mlp_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        num_hash = _int(raw, "num_hash_layers", 3)
        types = [HASH_MOE] * min(num_layers, num_hash) + [MOE] * max(0, num_layers - num_hash)
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"config.json: mlp_layer_types must list num_hidden_layers={num_layers} entries")
    bad = [t for t in types if t not in MLP_TYPES]
    if bad:
        raise ValueError(f"config.json: mlp_layer_types entries must be one of {MLP_TYPES}, got {bad}")
    return tuple(types)


def _rope_head_dim(raw: dict[str, Any], head_dim: int) -> int:
    if raw.get("partial_rotary_factor") is not None:
        dim = int(head_dim * float(raw["partial_rotary_factor"]))
        key = "partial_rotary_factor"
    else:
        dim = _int(raw, "qk_rope_head_dim", head_dim // 8)
        key = "qk_rope_head_dim"
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ValueError(
            f"config.json: {key} gives a rope dimension of {dim}; it must be even and in 2..head_dim"
        )
    return dim


def _yarn(params: dict[str, Any], where: str) -> dict[str, Any] | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"config.json: {where} rope type {kind!r} is not supported (default or yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"config.json: {where} needs {key!r} for YaRN")
    return {
        "factor": float(params["factor"]),
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
        "attention_factor": float(params.get("attention_factor", 1.0)),
    }


def _ropes(raw: dict[str, Any], rope_head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    params = raw.get("rope_parameters")
    if (
        isinstance(params, dict)
        and isinstance(params.get("main"), dict)
        and isinstance(params.get("compress"), dict)
    ):
        main, compress = params["main"], params["compress"]
        if _yarn(main, "rope_parameters['main']") is not None:
            raise ValueError("config.json: rope_parameters['main'] must be plain RoPE (rope_type 'default')")
        return (
            RopeSpec(float(main.get("rope_theta", raw.get("rope_theta", 10000.0))), None),
            RopeSpec(
                float(compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))),
                _yarn(compress, "rope_parameters['compress']"),
            ),
        )
    scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None) or {}
    theta = float(raw.get("rope_theta") or (scaling.get("rope_theta") if scaling else None) or 10000.0)
    return (
        RopeSpec(theta, None),
        RopeSpec(float(raw.get("compress_rope_theta", 160000.0)), _yarn(scaling, "rope_scaling")),
    )


def _fp8_block(raw: dict[str, Any]) -> tuple[int, int]:
    quant = raw.get("quantization_config")
    if quant:
        if not isinstance(quant, dict):
            raise ValueError("config.json: quantization_config must be an object")
        if quant.get("quant_method", "fp8") != "fp8":
            raise ValueError(
                f"config.json: quantization_config.quant_method={quant.get('quant_method')!r} is not supported; "
                "only DeepSeek's block FP8 ('fp8') is"
            )
        if quant.get("scale_fmt") not in (None, "ue8m0"):
            raise ValueError(
                f"config.json: quantization_config.scale_fmt={quant['scale_fmt']!r} is not supported"
            )
    return weight_block_size(raw)


def _expert_dtype(raw: dict[str, Any]) -> str | None:
    quant = raw.get("quantization_config") or {}
    value = raw.get("expert_dtype", quant.get("expert_dtype") if isinstance(quant, dict) else None)
    if value not in EXPERT_DTYPES:
        raise ValueError(f"config.json: expert_dtype={value!r} is not one of {EXPERT_DTYPES[1:]}")
    return value
