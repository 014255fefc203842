"""Decode step time against context length: a small DeepSeek-V4-shaped model against a DeepSeek-V3
(MLA) model of the same width and depth, on the CPU, through the engine's paged caches.

Both models get random weights and their engine cache groups (`cache_groups`, planned by
`plan_cache_layout`, allocated by `KVCaches`) filled with random rows for the whole context; one
decode step is then the model's `forward` at position L over the block tables of a sequence of L
tokens (every block present: a timing, not a memory, benchmark), plus the LM head of that row.
V4 reads its 128-token window, top-k CSA entries (after scoring L / 4 indexer keys) and L / 128
HCA entries; MLA reads all L latents. The median of `--repeats` steps is reported.

    python -m deepinfer.bench.v4_decode_step --contexts 1024,4096,16384,65536

On a GPU (`--device cuda --attention-backend triton`, run by device_check.sh) the same steps run
on the Triton kernels: V4's sparse attention and fused MoE, V3's MLA decode; `--out` writes the
rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deepinfer.cache_layout import plan_cache_layout
from deepinfer.model.config import ModelConfig
from deepinfer.model.registry import model_class
from deepinfer.runner.inputs import RowSpan
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.model_runner import make_attention_backend, prepare_backend
from deepinfer.utils import cdiv

BLOCK = 16
MAX_POSITIONS = 131072
YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 32,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
V4_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "sliding_window": 128,
    "compress_ratios": [4, 128, 4, 128, 0],  # CSA / HCA alternating, then the MTP module
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_hash_layers": 0,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": YARN,
    "max_position_embeddings": MAX_POSITIONS,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
V3_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 128,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "qk_nope_head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False,
}


def random_model(raw: dict, device: torch.device) -> torch.nn.Module:
    model = model_class(raw["model_type"]).from_config(ModelConfig.from_hf(raw))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
            else:
                param.fill_(1.0)
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.zero_()
    return model.eval().to(device)


@torch.inference_mode()
def decode_step_ms(
    model: torch.nn.Module, context: int, repeats: int, device: torch.device, backend_name: str
) -> float:
    groups = model.cache_groups(torch.float32)
    # Enough blocks in every group for the whole context (sliding groups included: no release).
    num_blocks = cdiv(context + 1, BLOCK)
    layout = plan_cache_layout(
        groups, BLOCK, num_blocks=num_blocks, max_num_seqs=num_blocks, max_num_batched_tokens=BLOCK
    )
    caches = KVCaches(layout, {"target": groups}, device)
    generator = torch.Generator().manual_seed(1)
    for tensors in caches.tensors:
        for tensor in tensors:
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
    view = caches.view("target")
    tables = [list(range(cdiv(context + 1, g.block_tokens))) for g in view.groups]
    backend = make_attention_backend(backend_name, model, BLOCK, device)
    times = []
    for _ in range(repeats + 1):  # the first step warms up (allocations, lazy init) and is dropped
        inputs = view.inputs([RowSpan(tables, context, [7])])
        start = time.perf_counter()
        prepare_backend(backend, inputs.meta)
        hidden = model(inputs.input_ids, inputs.positions, view.tensors, inputs.meta, backend)
        model.compute_logits(hidden[-1:])
        if device.type == "cuda":  # the step's kernels have run, not only been launched
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--attention-backend", default="auto", choices=("auto", "triton", "torch", "cpu_paged")
    )
    parser.add_argument("--out", help="also write the rows to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    contexts = [int(c) for c in args.contexts.split(",")]
    v4, v3 = random_model(V4_CONFIG, device), random_model(V3_CONFIG, device)
    rows = [
        (
            c,
            decode_step_ms(v4, c, args.repeats, device, args.attention_backend),
            decode_step_ms(v3, c, args.repeats, device, args.attention_backend),
        )
        for c in contexts
    ]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": str(device),
                    "attention_backend": args.attention_backend,
                    "rows": [{"context": c, "v4_ms": a, "v3_ms": b} for c, a, b in rows],
                },
                f,
                indent=2,
            )
    print("| context | V4-shaped decode step | V3 MLA decode step | V3 / V4 |")
    print("|---|---|---|---|")
    for context, ms_v4, ms_v3 in rows:
        print(f"| {context:,} | {ms_v4:.1f} ms | {ms_v3:.1f} ms | {ms_v3 / ms_v4:.2f} |")
    (first, v4_first, v3_first), (last, v4_last, v3_last) = rows[0], rows[-1]
    print(
        f"\ngrowth {first:,} -> {last:,} tokens: V4 x{v4_last / v4_first:.2f}, V3 MLA x{v3_last / v3_first:.2f}"
    )


if __name__ == "__main__":
    main()
