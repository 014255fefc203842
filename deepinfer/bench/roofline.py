"""`bench roofline`: this machine's compute and memory limits, and how close a result gets.

Model FLOPs per token (Llama-style decoder, one token attending to ``context_len`` positions):

    matmul params  P = L·[h·(n_q·d) + 2·h·(n_kv·d) + (n_q·d)·h + 3·h·i] + h·V
    FLOPs/token    = 2·P + L·4·n_q·d·context_len

h = hidden_size, i = intermediate_size, L = layers, n_q / n_kv = query / key-value heads,
d = head_dim, V = vocab. 2·P counts a multiply and an add per weight (Q, K, V, O projections,
the gated MLP's gate/up/down, the LM head); the embedding lookup is not a matmul. The attention
term is QKᵀ (2·n_q·d per position) plus the probability-weighted sum of V (2·n_q·d per position).
Norms, RoPE and softmax are O(h) and left out, as in the usual MFU convention.

Bytes per decoded token (decode is memory-bound): every weight is read once per step and shared
by the batch, and each sequence reads its own KV cache:

    bytes/token = weight_bytes / batch + 2·L·n_kv·d·context_len·kv_bytes_per_element
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deepinfer.bench.peak import DEFAULT_GEMM_SIZES, best_time, measure_gemm_flops
from deepinfer.bench.report import markdown_table, provenance, read_json, write_json
from deepinfer.config.flags import int_list_argument
from deepinfer.model.loader.source import default_model_path


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _require(config: Mapping[str, Any], keys: Sequence[str]) -> None:
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"model config is missing {', '.join(missing)}")


def matmul_params(config: Mapping[str, Any]) -> int:
    """Weights that take part in matmuls for one token (see the module docstring)."""
    _require(
        config,
        ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    )
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = _head_dim(config)
    per_layer = (
        hidden * heads * head_dim  # Q
        + 2 * hidden * kv_heads * head_dim  # K, V
        + heads * head_dim * hidden  # O
        + 3 * hidden * int(config["intermediate_size"])  # gate, up, down
    )
    return int(config["num_hidden_layers"]) * per_layer + hidden * int(config["vocab_size"])


def model_flops_per_token(config: Mapping[str, Any], context_len: int) -> float:
    """FLOPs to produce one token that attends to ``context_len`` positions (itself included)."""
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    attention = 4 * int(config["num_hidden_layers"]) * int(config["num_attention_heads"]) * _head_dim(config)
    return 2.0 * matmul_params(config) + attention * context_len


def kv_bytes_per_position(config: Mapping[str, Any], bytes_per_element: float) -> float:
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return 2.0 * int(config["num_hidden_layers"]) * kv_heads * _head_dim(config) * bytes_per_element


def model_bytes_per_token(
    config: Mapping[str, Any],
    context_len: float,
    batch_size: float = 1.0,
    weight_bytes: float | None = None,
    kv_bytes_per_element: float = 4.0,
) -> float:
    """Memory traffic to decode one token; ``weight_bytes`` defaults to fp32 matmul weights."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    weights = 4.0 * matmul_params(config) if weight_bytes is None else weight_bytes
    return weights / batch_size + kv_bytes_per_position(config, kv_bytes_per_element) * context_len


@dataclass(slots=True)
class Roofline:
    peak_flops: float
    peak_bytes_per_s: float
    gemm_flops_by_size: dict[int, float]
    copy_bytes_per_s: float
    add_bytes_per_s: float
    threads: int

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["gemm_flops_by_size"] = {str(k): v for k, v in self.gemm_flops_by_size.items()}
        return record


def measure_memory_bandwidth(size_mib: int, threads: int, repeats: int = 5) -> tuple[float, float]:
    """Best-of (copy, add) bandwidth in bytes/s on fp32 buffers far larger than the caches.

    copy moves 2 buffers' bytes (read + write), add 3 (two reads, one write).
    """
    import torch

    torch.set_num_threads(threads)
    elements = size_mib * 1024 * 1024 // 4
    src, other, dst = torch.rand(elements), torch.rand(elements), torch.empty(elements)
    nbytes = elements * 4
    copy_s = best_time(lambda: dst.copy_(src), repeats)
    add_s = best_time(lambda: torch.add(src, other, out=dst), repeats)
    return 2 * nbytes / copy_s, 3 * nbytes / add_s


def measure_read_bandwidth(size_mib: int, threads: int, repeats: int = 5) -> float:
    """Best-of bandwidth in bytes/s of reading an fp32 buffer far larger than the caches (a sum):
    what a batch-1 decode step does with its weights."""
    import torch

    torch.set_num_threads(threads)
    src = torch.rand(size_mib * 1024 * 1024 // 4)
    return src.numel() * 4 / best_time(lambda: src.sum(), repeats)


def measure_roofline(
    sizes: Sequence[int] = DEFAULT_GEMM_SIZES, threads: int = 2, size_mib: int = 256, repeats: int = 5
) -> Roofline:
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    gemm = measure_gemm_flops(sizes, threads, repeats)
    copy_bw, add_bw = measure_memory_bandwidth(size_mib, threads, repeats)
    return Roofline(
        peak_flops=max(gemm.values()),
        peak_bytes_per_s=max(copy_bw, add_bw),
        gemm_flops_by_size=gemm,
        copy_bytes_per_s=copy_bw,
        add_bytes_per_s=add_bw,
        threads=threads,
    )


@dataclass(slots=True)
class Utilization:
    """How much of the roofline a measured throughput uses."""

    flops_per_token: float
    bytes_per_token: float
    achieved_flops: float
    achieved_bytes_per_s: float
    mfu: float
    mbu: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def utilization(
    roofline: Roofline,
    config: Mapping[str, Any],
    total_tokens_per_s: float,
    output_tokens_per_s: float,
    context_len: float,
    batch_size: float = 1.0,
    weight_bytes: float | None = None,
    kv_bytes_per_element: float = 4.0,
) -> Utilization:
    """MFU over every processed token (prefill and decode); MBU over decoded tokens only.

    Prefill tokens cost FLOPs like decoded ones but share each weight read with the whole
    prompt, so memory traffic is charged to output tokens, where decode makes it the limit.
    """
    flops = model_flops_per_token(config, int(context_len))
    nbytes = model_bytes_per_token(config, context_len, batch_size, weight_bytes, kv_bytes_per_element)
    achieved_flops = total_tokens_per_s * flops
    achieved_bw = output_tokens_per_s * nbytes
    return Utilization(
        flops_per_token=flops,
        bytes_per_token=nbytes,
        achieved_flops=achieved_flops,
        achieved_bytes_per_s=achieved_bw,
        mfu=achieved_flops / roofline.peak_flops,
        mbu=achieved_bw / roofline.peak_bytes_per_s,
    )


def llama_config_from_gguf(path: str | Path) -> tuple[dict[str, Any], int]:
    """A Llama-style config dict and the total tensor bytes, read from a GGUF file's header."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key: str) -> Any:
        field = reader.get_field(key)
        if field is None:
            return None
        return field.contents()

    arch = value("general.architecture")
    if arch is None:
        raise ValueError(f"{path} has no general.architecture: not a model GGUF")
    heads = value(f"{arch}.attention.head_count")
    hidden = value(f"{arch}.embedding_length")
    vocab = value(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    config = {
        "architecture": arch,
        "hidden_size": hidden,
        "intermediate_size": value(f"{arch}.feed_forward_length"),
        "num_hidden_layers": value(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": value(f"{arch}.attention.key_length") or hidden // heads,
        "vocab_size": vocab,
    }
    weight_bytes = sum(int(tensor.n_bytes) for tensor in reader.tensors)
    return config, weight_bytes


# -- command line (`deepinfer bench roofline`) ----------------------------------------


def add_parser(commands: Any) -> None:
    p = commands.add_parser("roofline", help="measure FLOP/s and memory bandwidth; MFU/MBU of a result")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", type=int_list_argument, default=[256, 512, 1024, 2048], help="GEMM sizes")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size for copy/add")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result", help="a `bench serve` result JSON to convert into MFU/MBU")
    p.add_argument("--run-index", type=int, help="which run of the result (default: best throughput)")
    p.add_argument("--model-gguf", help="GGUF whose header gives the config (default: embedded model)")
    p.add_argument("--model-config", help="HF config.json instead of a GGUF")
    p.add_argument("--weight-bytes", type=float, help="bytes of weights read per step (default: GGUF size)")
    p.add_argument("--kv-bytes", type=float, default=4.0, help="bytes per KV cache element")
    p.add_argument("--json-out", help="write the measurement here")


def load_model_config(args: argparse.Namespace) -> tuple[dict[str, Any], float | None]:

    if args.model_config:
        return read_json(args.model_config), args.weight_bytes
    config, gguf_bytes = llama_config_from_gguf(args.model_gguf or default_model_path())
    return config, args.weight_bytes if args.weight_bytes is not None else float(gguf_bytes)


def run(args: argparse.Namespace) -> int:
    from deepinfer.bench.economics import throughput_from_result

    roofline = measure_roofline(args.sizes, args.threads, args.bandwidth_mib, args.repeats)
    rows = [
        [f"GEMM {n}×{n} fp32", flops / 1e9, "GFLOP/s"] for n, flops in roofline.gemm_flops_by_size.items()
    ]
    rows += [
        ["memory copy", roofline.copy_bytes_per_s / 1e9, "GB/s"],
        ["memory add", roofline.add_bytes_per_s / 1e9, "GB/s"],
    ]
    print(f"threads: {roofline.threads}")
    print(markdown_table(["measurement", "value", "unit"], rows))
    record: dict[str, Any] = {"benchmark": "roofline", **provenance(), "roofline": roofline.to_dict()}
    if args.result:
        result = read_json(args.result)
        _, _, index = throughput_from_result(result, args.run_index)
        summary = result["runs"][index]["summary"]
        config, weight_bytes = load_model_config(args)
        # A decoded token sees its prompt plus, on average, half of its reply.
        context = (summary["mean_input_tokens"] or 0) + (summary["mean_output_tokens"] or 0) / 2
        used = utilization(
            roofline,
            config,
            summary["total_token_throughput"] / summary["num_cards"],
            summary["output_throughput"] / summary["num_cards"],
            context,
            max(summary["mean_concurrency"], 1.0),
            weight_bytes,
            args.kv_bytes,
        )
        record["utilization"] = {**used.to_dict(), "context_len": context, "run_index": index}
        print(
            markdown_table(
                ["model FLOPs/token", "bytes/token", "MFU", "MBU"],
                [[used.flops_per_token, used.bytes_per_token, f"{used.mfu:.2%}", f"{used.mbu:.2%}"]],
            )
        )
    if args.json_out:
        write_json(args.json_out, record)
    return 0
