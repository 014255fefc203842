"""Tiny random DeepSeek-V4.1 checkpoints in the HF layout of DeepSeek's release.

There is no V4.1 in transformers, so the tensors are written from the shapes DeepSeek's engine
declares for each HF name (its parameter containers and name map), spelled out here on their
own, not taken from the loader under test:
- six backbone layers: sliding, C2, C2 (sharing layer 1's compressed KV and index keys, own
  indexer), C1 (the YoCo boundary, candidate-block source), C1 (sharing layer 3's KV and
  top-k), C1 (own indexer, layer 3's index keys); Engram on layers 1 and 4;
- two DSpark layers (`mtp.0.`, `mtp.1.`) with their own expert count, the first with the
  target projection, the last with the Markov and confidence heads;
- FP8 e4m3 weights with UE8M0 scales per 32x32 block, routed experts as FP4 e2m1 pairs with a
  UE8M0 scale per 32 inputs, Engram tables FP8 with a scale per row and 32 columns;
- hyper-connection mixers, sinks and routing biases in float32, everything else bfloat16;
- a two-block vision tower (`vision.*`, 4 heads of 12 channels, 14-pixel patches) and its
  projector (`aligner.*`, 2 x 2 patches per token), bfloat16 like DeepSeek's;
- two shards and model.safetensors.index.json.
The float32 values each quantized tensor stands for are returned next to the files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BLOCK = 32


def tiny_config(**text_overrides: Any) -> dict[str, Any]:
    text: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_nextn_predict_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 96,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0],
        "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 256,
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 2, 3, 5],
        "index_k_source_layer_ids": [1, 3],
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 4,
        "index_n_heads": 2,
        "index_head_dim": 64,
        "index_topk": 4,
        "hc_mult": 2,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "dspark_block_size": 4,
        "dspark_target_layer_ids": [1, 4],
        "dspark_markov_rank": 8,
        "dspark_noise_token_id": 5,
        "dspark_n_routed_experts": 2,
        "dspark_num_experts_per_tok": 1,
        "engram_layer_ids": [1, 4],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 50,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
    }
    text.update(text_overrides)
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "quantization_config": {
            "quant_method": "fp8",
            "expert_dtype": "fp4",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
        },
        "text_config": text,
        "vision_config": {
            "hidden_size": 48,
            "downsample_ratio": 2,
            "patch_size": 14,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
    }


@dataclass
class TinyV41:
    path: Path
    config: dict[str, Any]
    # Every tensor's float32 value, under its weight name (quantized ones: what they dequantize to).
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    # The stored quantized tensors: weight name -> (data, UE8M0 scale bytes as uint8).
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stored: dict[str, torch.Tensor] = field(default_factory=dict)  # everything written, by name


def _sources(ids: list[int], num_layers: int) -> list[int]:
    mapping = list(range(num_layers))
    for layer in range(min(ids), num_layers):
        mapping[layer] = max(s for s in ids if s <= layer)
    return mapping


def _next_prime(n: int) -> int:
    n += 1
    while any(n % d == 0 for d in range(2, math.isqrt(n) + 1)) or n < 2:
        n += 1
    return n


def engram_rows(text: dict[str, Any]) -> dict[int, int]:
    """Rows of each Engram layer's table: one prime-sized table per head and n-gram order."""
    used: set[int] = set()
    rows = {}
    for layer in text["engram_layer_ids"]:
        total = 0
        for _ in range(text["engram_max_ngram_size"] - 1):
            start = text["engram_vocab_size"] - 1
            for _ in range(text["engram_n_heads"]):
                prime = _next_prime(start)
                while prime in used:
                    prime = _next_prime(prime)
                used.add(prime)
                total += prime
                start = prime
        rows[layer] = total
    return rows


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Weight name -> (logical shape, storage: fp8 | fp4 | engram | f32 | bf16)."""
    t = config["text_config"]
    hidden, heads, head_dim, m = t["hidden_size"], t["num_attention_heads"], t["head_dim"], t["hc_mult"]
    n, nextn, inter, vocab = (
        t["num_hidden_layers"],
        t["num_nextn_predict_layers"],
        t["moe_intermediate_size"],
        t["vocab_size"],
    )
    kv = _sources(t["kv_source_layer_ids"], n)
    index = _sources(t["index_source_layer_ids"], n)
    index_k = _sources(t.get("index_k_source_layer_ids") or t["kv_source_layer_ids"], n)
    rows = engram_rows(t) if t.get("engram_layer_ids") else {}
    mix = (2 + m) * m
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((vocab, hidden), "bf16"),
        "image_start": ((hidden,), "bf16"),
        "image_end": ((hidden,), "bf16"),
        "image_newline": ((hidden,), "bf16"),
        "head.weight": ((vocab, hidden), "bf16"),
        "norm.weight": ((hidden,), "bf16"),
    }

    def block(prefix: str, layer: int, experts: int) -> None:
        ratio = t["compress_ratios"][layer]
        for kind in ("attn", "ffn"):
            shapes[f"{prefix}hc_{kind}_base"] = ((mix,), "f32")
            shapes[f"{prefix}hc_{kind}_fn"] = ((mix, m * hidden), "f32")
            shapes[f"{prefix}hc_{kind}_scale"] = ((3,), "f32")
        a = prefix + "attn."
        shapes[a + "attn_sink"] = ((heads,), "f32")
        shapes[a + "wq_a.weight"] = ((t["q_lora_rank"], hidden), "fp8")
        shapes[a + "q_norm.weight"] = ((t["q_lora_rank"],), "bf16")
        shapes[a + "wq_b.weight"] = ((heads * head_dim, t["q_lora_rank"]), "fp8")
        shapes[a + "wkv.weight"] = ((head_dim, hidden), "fp8")
        shapes[a + "kv_norm.weight"] = ((head_dim,), "bf16")
        groups = t["o_groups"]
        shapes[a + "wo_a.weight"] = ((groups * t["o_lora_rank"], head_dim * heads // groups), "fp8")
        shapes[a + "wo_b.weight"] = ((hidden, groups * t["o_lora_rank"]), "fp8")
        backbone = prefix.startswith("layers.")
        if backbone and ratio and kv[layer] == layer:
            shapes[a + "compressor.wkv.weight"] = ((head_dim, hidden), "bf16")
            if ratio == 2:
                shapes[a + "compressor.wgate.weight"] = ((head_dim, hidden), "bf16")
            shapes[a + "compressor.norm.weight"] = ((head_dim,), "bf16")
        if backbone and ratio and index[layer] == layer:
            shapes[a + "indexer.wq_b.weight"] = (
                (t["index_n_heads"] * t["index_head_dim"], t["q_lora_rank"]),
                "fp8",
            )
            shapes[a + "indexer.weights_proj.weight"] = ((t["index_n_heads"], hidden), "bf16")
            if index_k[layer] == layer:
                shapes[a + "indexer.wk.weight"] = ((t["index_head_dim"], head_dim), "bf16")
                shapes[a + "indexer.k_norm.weight"] = ((t["index_head_dim"],), "bf16")
        shapes[prefix + "attn_norm.weight"] = ((hidden,), "bf16")
        shapes[prefix + "ffn_norm.weight"] = ((hidden,), "bf16")
        f = prefix + "ffn."
        shapes[f + "gate.weight"] = ((experts, hidden), "bf16")
        shapes[f + "gate.bias"] = ((experts,), "f32")
        shapes[f + "gate.bias_vl"] = ((experts,), "f32")
        shared = inter * t["n_shared_experts"]
        shapes[f + "shared_experts.w1.weight"] = ((shared, hidden), "fp8")
        shapes[f + "shared_experts.w3.weight"] = ((shared, hidden), "fp8")
        shapes[f + "shared_experts.w2.weight"] = ((hidden, shared), "fp8")
        for e in range(experts):
            shapes[f"{f}experts.{e}.w1.weight"] = ((inter, hidden), "fp4")
            shapes[f"{f}experts.{e}.w3.weight"] = ((inter, hidden), "fp4")
            shapes[f"{f}experts.{e}.w2.weight"] = ((hidden, inter), "fp4")
        if backbone and layer in rows:
            per_table = t["engram_n_heads"] * t["engram_head_dim"]
            shapes[prefix + "engram.q_weight"] = ((m, hidden), "bf16")
            shapes[prefix + "engram.k_weight"] = ((m, hidden), "bf16")
            shapes[prefix + "engram.embed.weight"] = ((rows[layer], t["engram_head_dim"]), "engram")
            tables = t["engram_max_ngram_size"] - 1
            shapes[prefix + "engram.wkv.weight"] = ((hidden * (m + 1), per_table * tables), "fp8")

    for layer in range(n):
        block(f"layers.{layer}.", layer, t["n_routed_experts"])
    rank = t["dspark_markov_rank"]
    for d in range(nextn):
        p = f"mtp.{d}."
        block(p, n + d, t["dspark_n_routed_experts"])
        if d == 0:
            shapes[p + "main_proj.weight"] = ((hidden, len(t["dspark_target_layer_ids"]) * hidden), "fp8")
            shapes[p + "main_norm.weight"] = ((hidden,), "bf16")
        if d == nextn - 1:
            shapes[p + "norm.weight"] = ((hidden,), "bf16")
            shapes[p + "markov_head.embed.weight"] = ((vocab, rank), "bf16")
            shapes[p + "markov_head.head.weight"] = ((vocab, rank), "bf16")
            shapes[p + "confidence_head.proj.weight"] = ((1, hidden + rank), "bf16")
    if not t.get("hc_shifted", True):
        for p in ["", *([f"mtp.{nextn - 1}."] if nextn else [])]:
            shapes[p + "hc_head_base"] = ((m,), "f32")
            shapes[p + "hc_head_fn"] = ((m, m * hidden), "f32")
            shapes[p + "hc_head_scale"] = ((1,), "f32")
    shapes.update(vision_shapes(config))
    return shapes


def vision_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The vision tower's names as DeepSeek's name map gives them, shapes from its modules: linears
    with biases in the ViT's attention, patch embedding and projector, none in its SwiGLUs."""
    v, hidden = config["vision_config"], config["text_config"]["hidden_size"]
    width, inter, patch, d = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["downsample_ratio"]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "vision.patch_embed.proj.weight": ((width, 3 * patch * patch), "bf16"),
        "vision.patch_embed.proj.bias": ((width,), "bf16"),
    }
    for i in range(v["num_hidden_layers"]):
        b = f"vision.blocks.{i}."
        shapes[b + "norm1.weight"] = ((width,), "bf16")
        shapes[b + "attn.wqkv.weight"] = ((3 * width, width), "bf16")
        shapes[b + "attn.wqkv.bias"] = ((3 * width,), "bf16")
        shapes[b + "attn.wo.weight"] = ((width, width), "bf16")
        shapes[b + "attn.wo.bias"] = ((width,), "bf16")
        shapes[b + "norm2.weight"] = ((width,), "bf16")
        shapes[b + "mlp.w1.weight"] = ((2 * inter, width), "bf16")
        shapes[b + "mlp.w2.weight"] = ((width, inter), "bf16")
    shapes["vision.norm.weight"] = ((width,), "bf16")
    shapes["aligner.w1.weight"] = ((hidden, width * d * d), "bf16")
    shapes["aligner.w1.bias"] = ((hidden,), "bf16")
    shapes["aligner.w2.weight"] = ((hidden, hidden), "bf16")
    shapes["aligner.w2.bias"] = ((hidden,), "bf16")
    return shapes


def _ue8m0(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random power-of-two scales 2^-10 .. 2^-4: (raw bytes, float32 values)."""
    exponents = torch.randint(-10, -3, shape, generator=gen)
    return (exponents + 127).to(torch.uint8), torch.exp2(exponents.float())


def _fp8(
    shape: tuple[int, ...], block: tuple[int, int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = shape
    codes = (torch.randn(shape, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_bytes, scale = _ue8m0((-(-rows // block[0]), -(-cols // block[1])), gen)
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return codes, scale_bytes, codes.float() * full


def _fp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = shape
    nibbles = torch.randint(0, 16, (rows, cols), generator=gen)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale_bytes, scale = _ue8m0((rows, cols // BLOCK), gen)
    return packed, scale_bytes, E2M1[nibbles] * scale.repeat_interleave(BLOCK, 1)


def build_v41(path: Path, config: dict[str, Any], seed: int = 0, *, vision: bool = True) -> TinyV41:
    """`vision=False`: a text-only checkpoint (no `vision.*` / `aligner.*` tensors)."""
    gen = torch.Generator().manual_seed(seed)
    tiny = TinyV41(path=path, config=config)
    stored = tiny.stored
    for name, (shape, storage) in tensor_shapes(config).items():
        if not vision and name.startswith(("vision.", "aligner.")):
            continue
        if storage in ("fp8", "engram"):
            codes, scale_bytes, value = _fp8(shape, (BLOCK, BLOCK) if storage == "fp8" else (1, BLOCK), gen)
            stored[name], stored[name.removesuffix(".weight") + ".scale"] = (
                codes,
                scale_bytes.view(torch.float8_e8m0fnu),
            )
            tiny.quantized[name] = (codes, scale_bytes)
        elif storage == "fp4":
            packed, scale_bytes, value = _fp4(shape, gen)
            stored[name], stored[name.removesuffix(".weight") + ".scale"] = (
                packed,
                scale_bytes.view(torch.float8_e8m0fnu),
            )
            tiny.quantized[name] = (packed, scale_bytes)
        else:
            value = torch.randn(shape, generator=gen) * 0.1
            if storage == "bf16":
                value = value.to(torch.bfloat16).float()
            stored[name] = value if storage == "f32" else value.to(torch.bfloat16)
        tiny.values[name] = value
    write_checkpoint(path, config, stored)
    return tiny


def write_checkpoint(path: Path, config: dict[str, Any], stored: dict[str, torch.Tensor]) -> None:
    """config.json, two safetensors shards (backbone | the rest) and their index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    shards: dict[str, dict[str, torch.Tensor]] = {
        "model-00001-of-00002.safetensors": {},
        "model-00002-of-00002.safetensors": {},
    }
    for name, tensor in stored.items():
        shard = (
            "model-00001-of-00002.safetensors"
            if name.startswith("layers.")
            else "model-00002-of-00002.safetensors"
        )
        shards[shard][name] = tensor.contiguous()
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(path / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
