"""KV / state memory of DeepSeek-V4.1 at V4-Flash's dimensions against V4-Flash and V3.2-style
MLA, from the formula, and the host memory its Engram tables take.

The V4.1 figures come from the model's own cache declarations (deepinfer.model.deepseek_v4.v41_paged:
cache_declarations, the list the engine groups and allocates from): per layer the sliding-window
rows (the last W - 1 tokens); per C2 KV source the compressor-state row of the open pair; per KV
source one compressed entry of head_dim values per token (C1) or per two tokens (C2); per index-K
source one indexer key of index_head_dim values per token or pair; and the int64 token ids of the
last max_ngram_size - 1 positions that Engram reads. Layers that borrow a source's KV or keys
(the sharing maps) hold nothing. Values are counted at `--element-size` bytes (2: bf16, as
deepinfer/bench/v4_kv_memory.py counts V4), token ids at 8.

    python -m deepinfer.bench.v41_kv_memory           # markdown tables for docs/benchmarks.md

No V4.1 config.json is published in our references. The configs below are V4-Flash's published
dimensions (deepinfer/bench/v4_kv_memory.py's FLASH_CONFIG: 43 layers, head_dim 512, sliding window 128,
index_head_dim 128, ...) with V4.1's keys filled in by assumption (docs/benchmarks.md lists
which): the C1 / C2 layer pattern, the sharing maps and the Engram settings.
"""

from __future__ import annotations

import argparse
from typing import Any

from deepinfer.bench.v4_kv_memory import FLASH_CONFIG, LENGTHS, _size, mla_bytes, v4_bytes
from deepinfer.model.deepseek_v4.cache import INTEGER_KINDS, CacheKind
from deepinfer.model.deepseek_v4.v41_config import C1, C2, SLIDING, DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_paged import cache_declarations
from deepinfer.model.deepseek_v4.v41_weights import ENGRAM_SCALE_BLOCK

TOKEN_ID_BYTES = 8  # int64, whatever the element size
NUM_LAYERS = FLASH_CONFIG["num_hidden_layers"]
# Assumed: V4-Flash's two sliding-only layers, then its 20 HCA-position layers' count as C2 and
# the remaining 21 as C1; the first C1 layer (22) is the YoCo boundary.
SLIDING_LAYERS = [0, 1]
C2_LAYERS = list(range(2, 22))
C1_LAYERS = list(range(22, NUM_LAYERS))
RATIOS = [SLIDING] * len(SLIDING_LAYERS) + [C2] * len(C2_LAYERS) + [C1] * len(C1_LAYERS)
COMPRESSED = C2_LAYERS + C1_LAYERS
# Sharing maps (each layer uses the nearest source at or before it): none at all (every compressed
# layer its own KV, top-k and index-K source: the upper bound), or YoCo-style sharing (C2 layers
# in pairs as the tiny test fixture shares them; the C1 boundary's KV and index keys shared by
# every later C1 layer, "cache once"; every layer its own top-k).
SHARING = {
    "no sharing": {"kv": COMPRESSED, "index": COMPRESSED, "index_k": COMPRESSED},
    "YoCo sharing": {
        "kv": C2_LAYERS[::2] + C1_LAYERS[:1],
        "index": COMPRESSED,
        "index_k": C2_LAYERS[::2] + C1_LAYERS[:1],
    },
}
# Assumed Engram settings (no published value): two layers before the YoCo boundary (DeepSeek's
# engine asserts Engram layers precede it), 2- and 3-grams, 8 heads of 512 values per n-gram.
ENGRAM = {
    "engram_layer_ids": [2, 15],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 8,
    "engram_head_dim": 512,
    "engram_pad_token_id": 2,
}
# The parser requires DSpark's keys; with no DSpark layer counted they change no figure.
DSPARK = {
    "dspark_block_size": 16,
    "dspark_target_layer_ids": [1, 21],
    "dspark_markov_rank": 8,
    "dspark_noise_token_id": 5,
    "dspark_n_routed_experts": FLASH_CONFIG["n_routed_experts"],
    "dspark_num_experts_per_tok": FLASH_CONFIG["num_experts_per_tok"],
}
ENGRAM_VOCAB_SIZES = (1 << 20, 1 << 22, 1 << 24)  # nominal rows of one head's table


def v41_config(sharing: str, engram_vocab_size: int = ENGRAM_VOCAB_SIZES[0]) -> dict[str, Any]:
    """A V4.1 config.json at V4-Flash's dimensions (the keys DeepseekV41Arch reads)."""
    f = FLASH_CONFIG
    maps = SHARING[sharing]
    text = {
        **{
            k: f[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "qk_rope_head_dim",
                "q_lora_rank",
                "o_groups",
                "o_lora_rank",
                "sliding_window",
                "compress_rope_theta",
                "rope_theta",
                "max_position_embeddings",
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "hc_mult",
                "hc_eps",
                "hc_sinkhorn_iters",
                "n_routed_experts",
                "n_shared_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "routed_scaling_factor",
                "scoring_func",
                "norm_topk_prob",
                "swiglu_limit",
                "rms_norm_eps",
                "hidden_act",
            )
        },
        "num_hidden_layers": NUM_LAYERS,
        "num_nextn_predict_layers": 0,  # DSpark's layers keep no cache in the engine
        "attention_bias": False,
        "attention_dropout": 0.0,
        "compress_ratios": RATIOS,
        "rope_scaling": {k: v for k, v in f["rope_scaling"].items() if k != "type"},
        "kv_source_layer_ids": maps["kv"],
        "index_source_layer_ids": maps["index"],
        "index_k_source_layer_ids": maps["index_k"],
        "candidate_source_layer_id": None,  # two-level top-k: no cache of its own
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        **ENGRAM,
        "engram_vocab_size": engram_vocab_size,
        **DSPARK,
    }
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
        "vision_config": {"hidden_size": 1024, "downsample_ratio": 2, "patch_size": 14},
    }


def v41_bytes(config: dict[str, Any], num_tokens: int, element_size: int) -> dict[CacheKind, int]:
    """Bytes one sequence of num_tokens holds, per cache kind, summed over layers."""
    out: dict[CacheKind, int] = {}
    for decl in cache_declarations(DeepseekV41Arch.from_raw(config)):
        size = TOKEN_ID_BYTES if decl.kind in INTEGER_KINDS else element_size
        out[decl.kind] = out.get(decl.kind, 0) + decl.bytes_held(num_tokens, size)
    return out


def growth_per_token(kinds: dict[CacheKind, int], num_tokens: int) -> float:
    """What every further token adds: the compressed entries and index keys (the rest is windows)."""
    return (kinds.get(CacheKind.COMPRESSED_KV, 0) + kinds.get(CacheKind.INDEXER_KEYS, 0)) / num_tokens


def engram_host_bytes(config: dict[str, Any]) -> tuple[int, int]:
    """(table rows, bytes) of every Engram layer's FP8 table with its UE8M0 scales (one byte per
    row and ENGRAM_SCALE_BLOCK[1] values), as the checkpoint stores and the engine maps them."""
    engram = DeepseekV41Arch.from_raw(config).engram
    rows = sum(engram.layer_rows(layer) for layer in engram.layer_ids)
    return rows, rows * (engram.head_dim + engram.head_dim // ENGRAM_SCALE_BLOCK[1])


def _fine_size(n: float) -> str:
    """Sizes down to KiB: the C2 state and the token ids are a few rows per sequence."""
    if n < 2**10:
        return f"{n:.0f} B"
    return f"{n / 2**10:.1f} KiB" if n < 2**20 else _size(n)


def report(element_size: int) -> str:
    lines = [
        "| model | bytes / token (growth) | held per sequence, fixed | "
        + " | ".join(f"total at {k}" for k in LENGTHS)
        + " | vs V4-Flash at 1M | vs MLA latent at 1M |",
        "|---|---|---|" + "---|" * len(LENGTHS) + "---|---|",
    ]
    big = LENGTHS["1M"]
    flash_1m = sum(v4_bytes(FLASH_CONFIG, big, element_size).values())
    latent_1m = mla_bytes(big, element_size, with_indexer=False)
    rows: list[tuple[str, float, float, list[int]]] = []
    for sharing in SHARING:
        config = v41_config(sharing)
        kinds = v41_bytes(config, big, element_size)
        growth = growth_per_token(kinds, big)
        totals = [sum(v41_bytes(config, n, element_size).values()) for n in LENGTHS.values()]
        rows.append(
            (f"V4.1 at V4-Flash dims, {sharing} (assumed)", growth, totals[-1] - growth * big, totals)
        )
    flash = v4_bytes(FLASH_CONFIG, big, element_size)
    flash_growth = (flash[CacheKind.COMPRESSED_KV] + flash[CacheKind.INDEXER_KEYS]) / big
    flash_totals = [sum(v4_bytes(FLASH_CONFIG, n, element_size).values()) for n in LENGTHS.values()]
    rows.append(("DeepSeek-V4-Flash", flash_growth, flash_totals[-1] - flash_growth * big, flash_totals))
    for name, indexer in (("V3.2-style MLA (latent only)", False), ("V3.2 MLA + DSA indexer keys", True)):
        totals = [mla_bytes(n, element_size, indexer) for n in LENGTHS.values()]
        rows.append((name, mla_bytes(1, element_size, indexer), 0, totals))
    for name, growth, fixed, totals in rows:
        lines.append(
            f"| {name} | {growth:,.0f} B | {f'{fixed / 2**20:.1f} MiB' if fixed else 0} | "
            + " | ".join(_size(t) for t in totals)
            + f" | {100 * totals[-1] / flash_1m:.1f}% | {100 * totals[-1] / latent_1m:.1f}% |"
        )

    lines += ["", "| V4.1 cache kind at 1M | " + " | ".join(SHARING) + " |", "|---|" + "---|" * len(SHARING)]
    per_kind = [v41_bytes(v41_config(s), big, element_size) for s in SHARING]
    for kind in CacheKind:
        if any(kind in k for k in per_kind):
            lines.append(
                f"| {kind.value} | " + " | ".join(_fine_size(k.get(kind, 0)) for k in per_kind) + " |"
            )

    lines += [
        "",
        "| engram_vocab_size (per head) | table rows | Engram host memory (FP8 + scales) |",
        "|---|---|---|",
    ]
    for vocab in ENGRAM_VOCAB_SIZES:
        rows_total, size = engram_host_bytes(v41_config("no sharing", vocab))
        lines.append(f"| {vocab:,} | {rows_total:,} | {_size(size)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--element-size", type=int, default=2, help="bytes per cached value (2: bf16)")
    print(report(parser.parse_args().element_size))


if __name__ == "__main__":
    main()
