"""`deepinfer bench user-shapes`: the models users run, at their real shapes, from random values.

Writes checkpoints of Llama-3.2-1B, a Qwen3-1.7B-like model (QK-norm) and Llama-3.1-8B without
downloading anything: GGUF files as Q8_0, Q4_0 and Q4_K_M, and (1B and 1.7B) bf16 safetensors
directories. Then it measures batch-1 decode time per output token (TPOT) of the GGUF files and
sets it against this machine's memory-bandwidth roofline (deepinfer/bench/roofline.py's copy, add
and read bandwidth, the best of the three): at batch 1 every weight byte is read once per token, so

    roofline TPOT = (weight bytes read per token + KV bytes read per token) / bandwidth

and "% of roofline" is roofline TPOT / measured TPOT. The embedding lookup reads one row and is
not counted; a tied embedding is counted once, as the LM head. A VM's bandwidth moves by as much
as 1.7x from one minute to the next (neighbours), so each decode run gets its own roofline,
measured in the same process just before and after it (the higher of the two), and a model's
figure is its median run's. The read bandwidth alone (a sum over a buffer: what a decode step does
with its weights) is reported beside it.

The weights are valid blocks of random bytes with one fp16 scale per tensor, chosen so that the
weights have a standard deviation of 0.02-0.04 (as trained models): the kernels' work and bytes are
those of a real file of the type, the tokens they produce are noise. Quantization types follow
llama.cpp's choices: the LM head (a tied embedding included) is Q6_K in the Q4_0 and Q4_K_M
files, and Q4_K_M gives attn_v and ffn_down Q6_K in llama.cpp's `use_more_bits` layers.

The tokenizer is the default model's (SmolLM2's byte-level BPE), its vocabulary padded with
unreachable tokens to the real vocabulary size, so the embedding and LM head have their real
shapes; the safetensors directories carry the default model's tokenizer as transformers saves it
(tokenizer_config.json with the chat template), as a downloaded checkpoint does.

    .venv/bin/python -m deepinfer.cli bench user-shapes --shapes llama-3.2-1b --measure
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.bench.latency_vs_llama_cpp import ours_once
from deepinfer.bench.report import markdown_table, provenance, write_json


@dataclass(frozen=True, slots=True)
class Shape:
    arch: str  # GGUF architecture (llama, qwen3)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool
    rope_theta: float
    context: int


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, True, False, 500000.0, 131072),
    "qwen3-1.7b": Shape("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True, True, 1000000.0, 40960),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, 128256, False, False, 500000.0, 131072),
}
FILE_TYPES = ("Q8_0", "Q4_0", "Q4_K_M")
BF16_SHAPES = ("llama-3.2-1b", "qwen3-1.7b")  # an 8B in bf16 does not fit in 24 GiB as fp32

# Per block type: (bytes per block, values per block, offset of the fp16 scale(s), scale for a
# weight std of 0.02 over uniformly random quants, dmin (Q4_K: centres its unsigned values)).
_BLOCKS = {
    "Q8_0": (34, 32, 0, 0.02 / 74, None),  # int8 quants: std ~74
    "Q4_0": (18, 32, 0, 0.02 / 4.6, None),  # 4-bit quants less 8: std ~4.6
    "Q4_K": (144, 256, 0, 0.02 / (31 * 4.6), 7.5 * 0.02 / (31 * 4.6)),  # d * scale * q - dmin * min
    "Q6_K": (210, 256, 208, 0.02 / (74 * 18), None),  # d * int8 scale (~74) * (q - 32) (~18)
}


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: Shape, file_type: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, (rows, cols) or (length,), type) of every tensor, in file order."""
    low = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_K_M": "Q4_K"}[file_type]
    head = "Q8_0" if file_type == "Q8_0" else "Q6_K"
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (shape.vocab, h), head if shape.tied else low)
    ]
    for i in range(shape.layers):
        more = file_type == "Q4_K_M" and _use_more_bits(i, shape.layers)
        plan += [(f"blk.{i}.attn_norm.weight", (h,), "F32"), (f"blk.{i}.ffn_norm.weight", (h,), "F32")]
        if shape.qk_norm:
            plan += [(f"blk.{i}.attn_q_norm.weight", (shape.head_dim,), "F32")]
            plan += [(f"blk.{i}.attn_k_norm.weight", (shape.head_dim,), "F32")]
        plan += [
            (f"blk.{i}.attn_q.weight", (q, h), low),
            (f"blk.{i}.attn_k.weight", (kv, h), low),
            (f"blk.{i}.attn_v.weight", (kv, h), "Q6_K" if more else low),
            (f"blk.{i}.attn_output.weight", (h, q), low),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, h), low),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, h), low),
            (f"blk.{i}.ffn_down.weight", (h, shape.intermediate), "Q6_K" if more else low),
        ]
    plan.append(("output_norm.weight", (h,), "F32"))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, h), head))
    return plan


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row]: random quants, one fp16 scale (and Q4_K's min) per tensor."""
    size, values, at, d, dmin = _BLOCKS[kind]
    blocks = np.frombuffer(rng.bytes(rows * cols // values * size), dtype=np.uint8).copy()
    blocks = blocks.reshape(-1, size)
    blocks[:, at : at + 2] = np.array([d], dtype=np.float16).view(np.uint8)
    if dmin is not None:
        blocks[:, at + 2 : at + 4] = np.array([dmin], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _tokenizer_fields() -> dict[str, Any]:
    """The default model's tokenizer metadata (byte-level BPE), read once."""
    import gguf

    from deepinfer.model.loader.source import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    fields = {}
    for name in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id"):
        fields[name] = reader.fields[f"tokenizer.ggml.{name}"].contents()
    fields["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    return fields


def write_gguf(path: Path, shape: Shape, file_type: str, tokenizer: dict[str, Any], seed: int = 0) -> None:
    """The checkpoint, written tensor by tensor (never the whole model in memory)."""
    import gguf

    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    writer.add_name(f"{path.stem} (random values)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5 if shape.arch == "llama" else 1e-6)
    writer.add_vocab_size(shape.vocab)
    pad = shape.vocab - len(tokenizer["tokens"])  # unreachable tokens: the real vocabulary size
    writer.add_tokenizer_model(tokenizer["model"])
    writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list([*tokenizer["tokens"], *(f"<|unused_{i}|>" for i in range(pad))])
    writer.add_token_types([*tokenizer["token_type"], *([1] * pad)])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(tokenizer["bos_token_id"])
    writer.add_eos_token_id(tokenizer["eos_token_id"])
    writer.add_chat_template(tokenizer["chat_template"])
    plan = tensor_plan(shape, file_type)
    for name, dims, kind in plan:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            size, values = _BLOCKS[kind][:2]
            nbytes = dims[0] * dims[1] // values * size
            byte_shape = (dims[0], dims[1] // values * size)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType[kind]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, dims, kind in plan:
        if kind == "F32":
            writer.write_tensor_data((1 + 0.05 * rng.standard_normal(dims[0])).astype(np.float32))
        else:
            writer.write_tensor_data(random_blocks(kind, dims[0], dims[1], rng))
    writer.close()
    tmp.replace(path)


def write_bf16(directory: Path, shape: Shape, seed: int = 0) -> None:
    """A HF directory: config.json, bf16 model.safetensors, the default model's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from deepinfer.model.loader.source import default_model_path

    generator = torch.Generator().manual_seed(seed)
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def normal(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=generator) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(shape.vocab, h), "model.norm.weight": ones(h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(shape.intermediate, h),
            p + "mlp.up_proj.weight": normal(shape.intermediate, h),
            p + "mlp.down_proj.weight": normal(h, shape.intermediate),
        }
        if shape.qk_norm:
            weights |= {p + "self_attn.q_norm.weight": ones(shape.head_dim)}
            weights |= {p + "self_attn.k_norm.weight": ones(shape.head_dim)}
    if not shape.tied:
        weights["lm_head.weight"] = normal(shape.vocab, h)
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model_type = "qwen3" if shape.arch == "qwen3" else "llama"
    config = {
        "architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"],
        "model_type": model_type,
        "hidden_size": h,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.context,
        "rms_norm_eps": 1e-5 if model_type == "llama" else 1e-6,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    # As a downloaded checkpoint has it (tokenizer_config.json with the chat template), so vLLM
    # and our server's chat endpoints take the directory as they take a real one.
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.replace(directory)


def read_bytes_per_token(path: Path, shape: Shape, context: int, kv_bytes_per_element: float = 2.0) -> float:
    """Bytes a batch-1 decode step reads: every matrix but an untied embedding (one row of it),
    the norms, and the KV cache of `context` positions (fp16: the GGUF default)."""
    from deepinfer.model.loader.gguf_tensors import read_tensors

    tensors = read_tensors(path)
    names = {t.name for t in tensors}
    total = sum(
        t.data.nbytes for t in tensors if t.name != "token_embd.weight" or "output.weight" not in names
    )
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_bytes_per_element * context
    return float(total + kv)


def measure_tpot(
    path: str, threads: int, prompt_len: int, output_len: int, repeats: int, bandwidth_mib: int
) -> dict[str, Any]:
    """Batch-1 decode of `output_len` tokens after a `prompt_len`-token prompt, `repeats` times:
    each run's time per output token after the first, the bandwidth around it, and the load time."""
    from deepinfer import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(path, num_threads=threads, max_model_len=2048, kv_cache_memory="512MiB")
    load_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 40000, prompt_len)]  # real tokens of the vocabulary
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    per_token, bandwidths, reads = [], [], []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        before = _bandwidth(bandwidth_mib, threads)
        per_token.append(ours_once(llm.engine, prompt, output_len)[1])
        after = _bandwidth(bandwidth_mib, threads)
        bandwidths.append(max(*before, *after))
        reads.append(max(before[2], after[2]))
    return {
        "tpot_runs_s": per_token,
        "bandwidth_runs_bytes_per_s": bandwidths,
        "read_bandwidth_runs_bytes_per_s": reads,
        "load_s": load_s,
    }


def _bandwidth(size_mib: int, threads: int) -> tuple[float, float, float]:
    """(copy, add, read) bandwidth in bytes/s."""
    from deepinfer.bench.roofline import measure_memory_bandwidth, measure_read_bandwidth

    return (*measure_memory_bandwidth(size_mib, threads), measure_read_bandwidth(size_mib, threads))


def _in_own_process(*args: Any) -> dict[str, Any]:
    """measure_tpot in a fresh process: each model's memory (an interleaved copy of its weights)
    is returned to the system before the next loads."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_tpot, *args).result()


def add_parser(commands: Any) -> None:
    p = commands.add_parser("user-shapes", help="real-shape checkpoints from random values; TPOT vs roofline")
    p.add_argument(
        "--out-dir", default="build/user_shapes", help="where the checkpoints are written (reused)"
    )
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-3.2-1b"])
    p.add_argument("--types", nargs="+", choices=FILE_TYPES, default=list(FILE_TYPES))
    p.add_argument("--bf16", action="store_true", help="also write bf16 safetensors (1B and 1.7B shapes)")
    p.add_argument("--measure", action="store_true", help="measure batch-1 TPOT of the GGUF files")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth measure")
    p.add_argument("--json-out", help="write the figures here")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer: dict[str, Any] | None = None
    files: list[tuple[Shape, Path]] = []
    for name in args.shapes:
        shape = SHAPES[name]
        for file_type in args.types:
            path = out / f"{name}-{file_type}.gguf"
            if not path.exists():
                tokenizer = tokenizer or _tokenizer_fields()
                start = time.perf_counter()
                write_gguf(path, shape, file_type, tokenizer)
                print(
                    f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - start:.0f} s)"
                )
            files.append((shape, path))
        directory = out / f"{name}-bf16"
        if args.bf16 and name in BF16_SHAPES and not (directory / "config.json").exists():
            write_bf16(directory, shape)
            print(f"wrote {directory}")
    record: dict[str, Any] = {
        "benchmark": "user_shapes",
        **provenance(),
        "threads": args.threads,
        "models": [],
    }
    if args.measure:
        rows = []
        for shape, path in files:
            measured = _in_own_process(
                str(path), args.threads, args.prompt_len, args.output_len, args.repeats, args.bandwidth_mib
            )
            context = args.prompt_len + args.output_len / 2  # the mean position read by a decode step
            nbytes = read_bytes_per_token(path, shape, int(context))
            fractions = [
                nbytes / bandwidth / tpot
                for tpot, bandwidth in zip(measured["tpot_runs_s"], measured["bandwidth_runs_bytes_per_s"])
            ]
            median = sorted(range(len(fractions)), key=fractions.__getitem__)[len(fractions) // 2]
            bandwidth, tpot = measured["bandwidth_runs_bytes_per_s"][median], measured["tpot_runs_s"][median]
            read = measured["read_bandwidth_runs_bytes_per_s"][median]
            roofline_s = nbytes / bandwidth
            entry = {
                "model": path.name,
                **measured,
                "tpot_s": tpot,
                "bytes_per_token": nbytes,
                "bandwidth_bytes_per_s": bandwidth,
                "roofline_tpot_s": roofline_s,
                "fraction_of_roofline": fractions[median],
                "fraction_runs": fractions,
                "fraction_of_read_roofline": nbytes / read / tpot,
                "load_average": os.getloadavg()[0],  # a shared machine's figures need their context
            }
            record["models"].append(entry)
            rows.append([
                path.name, f"{nbytes / 2**20:.0f}", f"{bandwidth / 1e9:.1f}", f"{roofline_s * 1e3:.1f}",
                f"{tpot * 1e3:.1f}", f"{entry['fraction_of_roofline']:.0%}",
                " / ".join(f"{f:.0%}" for f in fractions), f"{read / 1e9:.1f}",
                f"{entry['fraction_of_read_roofline']:.0%}", f"{entry['load_average']:.1f}",
            ])  # fmt: skip
            print(rows[-1])
        headers = [
            "model",
            "MiB read/token",
            "bandwidth GB/s",
            "roofline TPOT ms",
            "TPOT ms",
            "% of roofline (median run)",
            "every run",
            "read GB/s (median run)",
            "% of read roofline",
            "load average",
        ]
        print(markdown_table(headers, rows))
    if args.json_out:
        write_json(args.json_out, record)
    return 0
