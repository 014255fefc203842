"""Tiny random DeepSeek-V4 checkpoints in the on-disk format of DeepSeek's release, with HF references.

A checkpoint directory holds what a release holds: config.json (transformers' dialect or
DeepSeek's published one), safetensors shards with DeepSeek's tensor names (`embed.weight`,
`layers.{i}.attn.wq_a.weight`, per-expert `ffn.experts.{e}.w1.weight`, `hc_attn_fn`, the MTP
module under `mtp.0.`), optionally FP8 weights with e8m0 128x128 block scales (`X.scale`) and
MXFP4 routed experts (int8 e2m1 pairs, one e8m0 scale per 32 inputs), and a tokenizer. The HF
transformers DeepseekV4ForCausalLM holding the same (dequantized) weights is the reference; the
MTP module's block is an HF decoder layer (HF itself does not run MTP).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.deepseek.tiny_checkpoint import build_tokenizer, write_tokenizer

HEAD_GAIN = 4.0
# HF parameter names -> DeepSeek's (the inverse of transformers' conversion mapping for V4).
_RENAMES = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"compressor\.kv_proj\.", "compressor.wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.", ".ffn."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
]
FP8_MATRIX = re.compile(
    r".*\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight|.*shared_experts\.w[123]\.weight|mtp\.\d+\.[eh]_proj\.weight"
)
ROUTED_EXPERT = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight")


def tiny_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """transformers' dialect: all three layer types, two hash layers, CSA at 4, HCA at 8."""
    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 3,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 1.5,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 128,  # = YaRN's factor * original_max_position_embeddings
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def official_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """DeepSeek's published dialect, FP8 with MXFP4 experts: sliding, CSA (4), HCA (128)."""
    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 16,
        "compress_ratios": [0, 4, 128, 0],
        "num_hash_layers": 1,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 10.0,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 64,
            "type": "yarn",
        },
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


@dataclass
class TinyV4:
    path: Path
    config: dict[str, Any]
    hf: torch.nn.Module  # DeepseekV4ForCausalLM with the main model's (dequantized) weights
    mtp_block: torch.nn.Module  # HF decoder layer holding the MTP module's block
    mtp_head: torch.nn.Module  # HF hyper head holding the MTP module's hc_head_* weights
    mtp_weights: dict[str, torch.Tensor]  # e_proj, h_proj, enorm, hnorm, norm, hc_head_* (dequantized)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # what was written, by name
    references: dict[str, torch.Tensor] = field(default_factory=dict)  # dequantized, by weight name


def hf_config(config: dict[str, Any], extra_layers: int = 0):
    """transformers' config for `config`, with `extra_layers` more (sliding, moe) layers appended."""
    from transformers import DeepseekV4Config

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    if extra_layers:
        cfg = DeepseekV4Config(**kwargs)
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim")
        }
        kwargs.update(
            num_hidden_layers=cfg.num_hidden_layers + extra_layers,
            layer_types=list(cfg.layer_types) + ["sliding_attention"] * extra_layers,
            mlp_layer_types=list(cfg.mlp_layer_types) + ["moe"] * extra_layers,
            compress_rates=dict(cfg.compress_rates),
            partial_rotary_factor=cfg.partial_rotary_factor,
            rope_parameters=cfg.rope_parameters,
        )
    return DeepseekV4Config(**kwargs, attn_implementation="eager")


def official_names(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """HF state dict -> DeepSeek's names; stacked experts split per expert, layer num_layers -> mtp.0."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().clone().contiguous()
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        name = re.sub(rf"^layers\.{num_layers}\.", "mtp.0.", name)
        if name.endswith("ffn.experts.gate_up_proj"):
            base, half = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w1.weight"] = tensor[e, :half].clone()
                out[f"{base}.{e}.w3.weight"] = tensor[e, half:].clone()
        elif name.endswith("ffn.experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w2.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def _randomize(model: torch.nn.Module, generator: torch.Generator, num_experts: int, top_k: int) -> None:
    """Random weights large enough that logits are peaked (greedy has no near-ties); every
    gate, bias and mixing weight non-trivial so each path is exercised."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("hc.fn", "hc_fn")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 / param.shape[-1] ** 0.5)
            elif name.endswith(("hc.base", "hc_base")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("hc.scale", "hc_scale")):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("sinks", "position_bias")):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                gain = HEAD_GAIN if name == "lm_head.weight" else 1.5
                param.copy_(torch.randn(param.shape, generator=generator) * (gain / param.shape[-1] ** 0.5))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.rand(buf.shape, generator=generator))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(buf.shape[0])]
                buf.copy_(torch.stack(rows))


def e8m0_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= top, as float8_e8m0fnu."""
    exponent = torch.ceil(torch.log2(amax.clamp(min=1e-30) / top))
    return torch.exp2(exponent).to(torch.float8_e8m0fnu)


def quantize_fp8_e8m0(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [M, N] -> (float8_e4m3fn [M, N], e8m0 scales [ceil(M/128), ceil(N/128)]), tile by tile."""
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float8_e8m0fnu)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = e8m0_scale(tile.abs().max(), 448.0)
            scale[i, j] = s
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s.float()).to(
                torch.float8_e4m3fn
            )
    return quantized, scale


def dequantize_fp8_reference(quantized: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(quantized.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = quantized[rows, cols].float() * float(scale[i, j].float())
    return out


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [M, N] -> (int8 [M, N/2], low nibble = even column; e8m0 scales [M, N/32])."""
    rows, cols = weight.shape
    blocks = weight.view(rows, cols // 32, 32)
    scale = e8m0_scale(blocks.abs().amax(dim=-1), 6.0)
    scaled = blocks / scale.float().unsqueeze(-1)
    grid = torch.tensor(E2M1)
    magnitude = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)  # nearest e2m1 magnitude
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).view(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale


def dequantize_mxfp4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element by element, the obvious way."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half)
    raw = packed.view(torch.uint8).tolist()
    scales = scale.float().tolist()
    for r in range(rows):
        for c in range(half):
            for k, code in enumerate((raw[r][c] & 0xF, raw[r][c] >> 4)):
                value = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
                col = 2 * c + k
                out[r, col] = value * scales[r][col // 32]
    return out


def build_v4(
    directory: Path,
    make_config: Callable[[int], dict[str, Any]],
    *,
    seed: int,
    quantize: bool = False,
    tokenizer_json: str | None = None,
) -> TinyV4:
    """make_config(vocab_size) -> config.json; the tokenizer (default: a small BPE trained here;
    `tokenizer_json`: e.g. DeepSeek V4's own) decides the vocabulary."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    directory.mkdir(parents=True, exist_ok=True)
    vocab = (
        build_tokenizer(directory) if tokenizer_json is None else write_tokenizer(directory, tokenizer_json)
    )
    config = make_config(vocab)
    num_layers = config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    # One extra decoder layer holds the MTP module's block: layer index num_layers.
    big = DeepseekV4ForCausalLM(hf_config(config, extra_layers=1)).eval()
    _randomize(big, generator, config["n_routed_experts"], config["num_experts_per_tok"])
    hidden = config["hidden_size"]
    hc = config["hc_mult"]
    mtp_weights = {
        "e_proj.weight": torch.randn(hidden, hidden, generator=generator) * (1.5 / hidden**0.5),
        "h_proj.weight": torch.randn(hidden, hidden, generator=generator) * (1.5 / hidden**0.5),
        "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
        "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
        "norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
        "hc_head_fn": torch.randn(hc, hc * hidden, generator=generator) * 0.3 / (hc * hidden) ** 0.5,
        "hc_head_base": 0.5 * torch.randn(hc, generator=generator),
        "hc_head_scale": 1.0 + 0.2 * torch.randn(1, generator=generator),
    }
    tensors = official_names(big.state_dict(), num_layers)
    tensors.update({f"mtp.0.{k}": v for k, v in mtp_weights.items()})

    references: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    if quantize:
        for name in sorted(tensors):
            if FP8_MATRIX.fullmatch(name):
                quantized, scale = quantize_fp8_e8m0(tensors[name])
                references[name] = dequantize_fp8_reference(quantized, scale)
            elif ROUTED_EXPERT.fullmatch(name):
                quantized, scale = quantize_mxfp4(tensors[name])
                references[name] = dequantize_mxfp4_reference(quantized, scale)
            else:
                continue
            tensors[name] = quantized
            scales[name.removesuffix(".weight") + ".scale"] = scale
        dequantized_state = {n: references.get(n, t) for n, t in tensors.items() if n not in scales}
        _load_official_into_hf(big, dequantized_state, num_layers)
        for key in list(mtp_weights):
            mtp_weights[key] = references.get(f"mtp.0.{key}", mtp_weights[key])

    # Two shards; half of the scales in the first, ahead of their weights in the second, so the
    # loader meets scales both before and after their weights.
    names = sorted(tensors)
    scale_names = sorted(scales)
    first = {n: tensors[n] for n in names[: len(names) // 2]} | {n: scales[n] for n in scale_names[::2]}
    second = {n: tensors[n] for n in names[len(names) // 2 :]} | {n: scales[n] for n in scale_names[1::2]}
    save_file(first, str(directory / "model-00001-of-00002.safetensors"))
    save_file(second, str(directory / "model-00002-of-00002.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))

    hf = DeepseekV4ForCausalLM(hf_config(config)).eval()
    prefix = f"model.layers.{num_layers}."
    hf.load_state_dict({k: v for k, v in big.state_dict().items() if not k.startswith(prefix)})
    hf.generation_config.eos_token_id = None  # EOS is an ordinary token in these tests
    head = DeepseekV4HyperHead(hf.config).eval()
    with torch.no_grad():
        head.hc_fn.copy_(mtp_weights["hc_head_fn"])
        head.hc_base.copy_(mtp_weights["hc_head_base"])
        head.hc_scale.copy_(mtp_weights["hc_head_scale"])
    return TinyV4(
        directory, config, hf, big.model.layers[num_layers], head, mtp_weights, tensors | scales, references
    )


def _load_official_into_hf(
    model: torch.nn.Module, official: dict[str, torch.Tensor], num_layers: int
) -> None:
    """Write DeepSeek-named (dequantized) tensors back into the HF model they came from."""
    with torch.no_grad():
        for hf_name, tensor in model.state_dict().items():  # shares storage with the parameters
            names = list(official_names({hf_name: tensor}, num_layers))
            if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                base = names[0].rsplit(".", 3)[0]  # "...ffn.experts"
                for e in range(tensor.shape[0]):
                    if hf_name.endswith("gate_up_proj"):
                        parts = (official[f"{base}.{e}.w1.weight"], official[f"{base}.{e}.w3.weight"])
                        tensor[e].copy_(torch.cat(parts))
                    else:
                        tensor[e].copy_(official[f"{base}.{e}.w2.weight"])
            else:
                tensor.copy_(official[names[0]])
