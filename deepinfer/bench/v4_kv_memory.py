"""KV / state memory of DeepSeek-V4-Flash and V4-Pro against V3.2-style MLA, from the formula.

The V4 figures come from the model's own cache declarations (deepinfer.model.deepseek_v4.model:
cache_declarations, the same list the engine allocates from): per layer the sliding-window rows
(the last W - 1 tokens), the compressor-state rows of the open window(s), the compressed entries
(one per 4 tokens on CSA layers, one per 128 on HCA layers) and the indexer keys (CSA). MLA keeps
kv_lora_rank + qk_rope_head_dim values per token and layer (plus, on V3.2, the DSA indexer's key
of index_head_dim). Everything is counted at 2 bytes per value (bf16); the MTP module's own
sliding window is left out (it is only held while MTP speculation runs).

    python -m deepinfer.bench.v4_kv_memory            # markdown tables for docs/benchmarks.md

Config values are DeepSeek's published config.json files (deepseek-ai/DeepSeek-V4-Flash,
deepseek-ai/DeepSeek-V4-Pro, deepseek-ai/DeepSeek-V3.2 on the Hugging Face hub), as quoted in the
public sources listed in docs/benchmarks.md; only the keys the architecture reads are kept.
"""

from __future__ import annotations

import argparse

from deepinfer.model.deepseek_v4.cache import CacheKind, kv_cache_bytes
from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.deepseek_v4.model import cache_declarations

_COMMON = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_hash_layers": 3,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "expert_dtype": "fp4",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}
FLASH_CONFIG = {
    **_COMMON,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_topk": 512,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    # two sliding-window layers, then CSA / HCA alternating; the last entry is the MTP module's
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
PRO_CONFIG = {
    **_COMMON,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "o_lora_rank": 1024,
    "index_topk": 1024,
    "n_routed_experts": 384,
    "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5,
    # two HCA layers, then CSA / HCA alternating; the last entry is the MTP module's
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}
V32_MLA = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
LENGTHS = {"8k": 8192, "128k": 131072, "1M": 1048576}
KIND_LABELS = {
    CacheKind.SLIDING_KV: "sliding-window KV",
    CacheKind.COMPRESSOR_STATE: "compressor state",
    CacheKind.COMPRESSED_KV: "compressed KV",
    CacheKind.INDEXER_STATE: "indexer state",
    CacheKind.INDEXER_KEYS: "indexer keys",
}


def v4_bytes(config: dict, num_tokens: int, element_size: int) -> dict[CacheKind, int]:
    arch = DeepseekV4Arch.from_raw(config)
    decls = [d for d in cache_declarations(arch) if d.layer < arch.num_layers]
    return kv_cache_bytes(decls, num_tokens, element_size)


def mla_bytes(num_tokens: int, element_size: int, with_indexer: bool) -> int:
    per_layer = V32_MLA["kv_lora_rank"] + V32_MLA["qk_rope_head_dim"]
    if with_indexer:
        per_layer += V32_MLA["index_head_dim"]
    return V32_MLA["num_hidden_layers"] * per_layer * element_size * num_tokens


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def report(element_size: int) -> str:
    lines = [
        "| model | bytes / token (growth) | held per sequence, fixed | "
        + " | ".join(f"total at {k}" for k in LENGTHS)
        + " | vs MLA latent at 1M | vs MLA + indexer at 1M |",
        "|---|---|---|" + "---|" * len(LENGTHS) + "---|---|",
    ]
    latent_1m = mla_bytes(LENGTHS["1M"], element_size, with_indexer=False)
    reference_1m = mla_bytes(LENGTHS["1M"], element_size, with_indexer=True)
    for name, config in (("DeepSeek-V4-Flash", FLASH_CONFIG), ("DeepSeek-V4-Pro", PRO_CONFIG)):
        big = LENGTHS["1M"]
        kinds = v4_bytes(config, big, element_size)
        growing = (
            sum(v for k, v in kinds.items() if k in (CacheKind.COMPRESSED_KV, CacheKind.INDEXER_KEYS)) / big
        )
        fixed = sum(v for k, v in kinds.items() if k not in (CacheKind.COMPRESSED_KV, CacheKind.INDEXER_KEYS))
        totals = [sum(v4_bytes(config, n, element_size).values()) for n in LENGTHS.values()]
        lines.append(
            f"| {name} | {growing:,.0f} B | {fixed / 2**20:.1f} MiB | "
            + " | ".join(_size(t) for t in totals)
            + f" | {100 * totals[-1] / latent_1m:.1f}% | {100 * totals[-1] / reference_1m:.1f}% |"
        )
    for name, indexer in (("V3.2-style MLA (latent only)", False), ("V3.2 MLA + DSA indexer keys", True)):
        per_token = mla_bytes(1, element_size, indexer)
        totals = [mla_bytes(n, element_size, indexer) for n in LENGTHS.values()]
        lines.append(
            f"| {name} | {per_token:,} B | 0 | "
            + " | ".join(_size(t) for t in totals)
            + f" | {100 * totals[-1] / latent_1m:.1f}% | {100 * totals[-1] / reference_1m:.1f}% |"
        )
    lines += ["", "| V4 cache kind | Flash at 1M | Pro at 1M |", "|---|---|---|"]
    flash, pro = (
        v4_bytes(FLASH_CONFIG, LENGTHS["1M"], element_size),
        v4_bytes(PRO_CONFIG, LENGTHS["1M"], element_size),
    )
    for kind, label in KIND_LABELS.items():
        lines.append(f"| {label} | {_size(flash.get(kind, 0))} | {_size(pro.get(kind, 0))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--element-size", type=int, default=2, help="bytes per cached value (2: bf16)")
    print(report(parser.parse_args().element_size))


if __name__ == "__main__":
    main()
