"""Tiny random DeepSeek checkpoints in the official on-disk format, with their HF references.

A checkpoint directory holds what a real DeepSeek release holds: config.json in the official
style (rope_scaling with "type": "yarn", quantization_config for FP8), safetensors shards with the
official tensor names (per-expert weights, MTP module as layer num_hidden_layers, FP8 weights
with 128x128 `weight_scale_inv` tiles), and a byte-level BPE tokenizer with DeepSeek's special
tokens. The HF transformers model is built with the same (dequantized) weights as the reference.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = [BOS, EOS, "<｜▁pad▁｜>"]
ADDED_TOKENS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "DeepSeek models cache one small latent vector per token. ",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Mixture of experts activates a small part of the weights for every token. ",
    "The capital of France is Paris, and the capital of Italy is Rome. ",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Speculative decoding drafts tokens that the main model verifies in one step. ",
]

# Output heads get a larger gain than other matrices: logit gaps well above float noise.
HEAD_GAIN = 4.0
QUANTIZED = re.compile(r"model\.layers\.\d+\..*(proj|proj_with_mqa)\.weight")
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def write_tokenizer(directory: Path, tokenizer_json: str) -> int:
    """Use a given tokenizer.json (e.g. DeepSeek V4's own) for the checkpoint; returns its size."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_tokenizer_config(directory, add_bos=False)
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _write_tokenizer_config(directory: Path, *, add_bos: bool) -> None:
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": add_bos,
                "add_eos_token": False,
                "bos_token": {"content": BOS, "special": True},
                "eos_token": {"content": EOS, "special": True},
                "model_max_length": 4096,
                "tokenizer_class": "LlamaTokenizerFast",
            },
            ensure_ascii=False,
        )
    )


def build_tokenizer(directory: Path) -> int:
    """Train a small byte-level BPE with DeepSeek's special tokens; returns its vocabulary size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_tokenizer_config(directory, add_bos=True)
    return tokenizer.get_vocab_size(with_added_tokens=True)


def deepseek_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """An official-style DeepSeek-V3 config.json, scaled down."""
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 160,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "v_head_dim": 24,
        "qk_nope_head_dim": 32,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 8.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
            "type": "yarn",
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


@dataclass
class TinyCheckpoint:
    path: Path
    config: dict[str, Any]
    hf: torch.nn.Module  # DeepseekV3ForCausalLM (or V2/V3.2) with the main model's weights
    mtp_block: torch.nn.Module | None  # HF decoder layer with the MTP module's block weights
    mtp_weights: dict[str, torch.Tensor]  # enorm, hnorm, eh_proj, shared_head.norm, shared_head.head


def _hf_classes(model_type: str):
    import transformers

    prefix = {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2", "deepseek_v32": "DeepseekV32"}[
        model_type
    ]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def _hf_config(config: dict[str, Any], num_layers: int):
    config_cls, _ = _hf_classes(config["model_type"])
    kwargs = {
        k: v for k, v in config.items() if k not in ("architectures", "quantization_config", "torch_dtype")
    }
    kwargs["num_hidden_layers"] = num_layers
    return config_cls(**kwargs, attn_implementation="eager")


def _official_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF state dict -> official names (stacked experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                out[f"{base}.{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def _set_hf_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Write an official-named tensor back into the HF model (experts go into their stacked slot)."""
    params = dict(model.named_parameters())
    expert = EXPERT.fullmatch(name)
    with torch.no_grad():
        if expert is None:
            params[name].copy_(value)
            return
        base, e, kind = expert.group(1), int(expert.group(2)), expert.group(3)
        if kind == "down_proj":
            params[f"{base}.down_proj"][e].copy_(value)
        else:
            stacked = params[f"{base}.gate_up_proj"]
            half = stacked.shape[1] // 2
            rows = slice(0, half) if kind == "gate_proj" else slice(half, 2 * half)
            stacked[e, rows].copy_(value)


def quantize_block_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [M, N] -> (float8_e4m3fn [M, N], float32 scale_inv [ceil(M/128), ceil(N/128)])."""
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block), -(-cols // block))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(
                torch.float8_e4m3fn
            )
    return quantized, scale


def dequantize_reference(quantized: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Tile by tile, the obvious way: the oracle for the loader's vectorized dequantization."""
    out = torch.empty(quantized.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = quantized[rows, cols].float() * scale[i, j]
    return out


def _peak(model: torch.nn.Module, generator: torch.Generator, bias_scale: float) -> None:
    """Random weights large enough that logits are peaked (greedy has no near-ties), routing bias
    non-zero so the correction bias is exercised."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                gain = HEAD_GAIN if name == "lm_head.weight" else 1.5
                param.copy_(torch.randn(param.shape, generator=generator) * (gain / param.shape[-1] ** 0.5))
        for name, buf in model.named_buffers():  # HF keeps the correction bias as a buffer
            if name.endswith("e_score_correction_bias"):
                buf.copy_(bias_scale * torch.rand(buf.shape, generator=generator))


def build_checkpoint(
    directory: Path,
    config_overrides: dict[str, Any],
    *,
    fp8: bool,
    seed: int,
    tokenizer_json: str | None = None,
) -> TinyCheckpoint:
    """`tokenizer_json`: the checkpoint's tokenizer (default: a small BPE trained here)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = (
        build_tokenizer(directory) if tokenizer_json is None else write_tokenizer(directory, tokenizer_json)
    )
    config = deepseek_config(vocab, **config_overrides)
    if fp8:
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    num_layers, num_mtp = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0)
    _, model_cls = _hf_classes(config["model_type"])
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    # One extra decoder layer serves as the MTP module's block: layer index num_hidden_layers.
    big = model_cls(_hf_config(config, num_layers + num_mtp)).eval()
    _peak(big, generator, bias_scale=0.3)
    hidden = config["hidden_size"]
    mtp_weights: dict[str, torch.Tensor] = {}
    if num_mtp:
        mtp_weights = {
            "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
            "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
            "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator)
            * (1.5 / (2 * hidden) ** 0.5),
            "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
            "shared_head.head.weight": torch.randn(vocab, hidden, generator=generator)
            * (HEAD_GAIN / hidden**0.5),
        }
    tensors = _official_tensors(big)
    prefix = f"model.layers.{num_layers}."
    for key, value in mtp_weights.items():
        tensors[prefix + key] = value
    if num_mtp:
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()

    scales: dict[str, torch.Tensor] = {}
    if fp8:
        for name in [n for n in tensors if QUANTIZED.fullmatch(n)]:
            quantized, scale = quantize_block_fp8(tensors[name])
            dequantized = dequantize_reference(quantized, scale)
            tensors[name] = quantized
            scales[name + "_scale_inv"] = scale
            if name.startswith(prefix) and name.removeprefix(prefix) in mtp_weights:
                mtp_weights[name.removeprefix(prefix)] = dequantized
            else:
                _set_hf_tensor(big, name, dequantized)

    # Two shards; half of the scales sit in the first, ahead of their weights in the second, so
    # the loader meets scales both before and after their weights.
    names = sorted(tensors)
    scale_names = sorted(scales)
    first = {n: tensors[n] for n in names[: len(names) // 2]} | {n: scales[n] for n in scale_names[::2]}
    second = {n: tensors[n] for n in names[len(names) // 2 :]} | {n: scales[n] for n in scale_names[1::2]}
    save_file(first, str(directory / "model-00001-of-00002.safetensors"))
    save_file(second, str(directory / "model-00002-of-00002.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))

    hf = model_cls(_hf_config(config, num_layers)).eval()
    state = {k: v for k, v in big.state_dict().items() if not k.startswith(prefix)}
    hf.load_state_dict(state)
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token
    mtp_block = big.model.layers[num_layers] if num_mtp else None
    return TinyCheckpoint(directory, config, hf, mtp_block, mtp_weights)
