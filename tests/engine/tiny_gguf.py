"""A tiny Llama GGUF in mixed formats, written with the `gguf` package (the real file format).

Random weights and a byte-level BPE vocabulary of 260 tokens (three specials, the 256 GPT-2 byte
symbols and the one merge " t"), so the loader's tokenizer conversion runs as for any GGUF, quickly. The formats are chosen so that loading exercises every case of the packed path:
a fused q/k/v of two formats (Q4_K, Q4_K, Q6_K), one with an F16 member (dense fallback: its packed
siblings get dequantized), each of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K somewhere, an untied Q6_K LM
head, a Q4_0 embedding.
`NEWER_LAYER_FORMATS` are the formats of Q5_K_M and Q3_K_M files (Q5_0, Q5_1, Q3_K, Q5_K) and a
Q2_K projection, which no kernel computes on (the dequantizing fallback).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tests.kernels.gguf_testing import random_packed

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
LAYER_FORMATS = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0",
     "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0"},
    {"attn_q": "F16", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
     "ffn_gate": "Q6_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
]  # fmt: skip
NEWER_LAYER_FORMATS = [
    {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
     "ffn_gate": "Q3_K", "ffn_up": "Q3_K", "ffn_down": "Q5_1"},
    {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q5_K", "attn_output": "Q3_K",
     "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q5_K"},
]  # fmt: skip


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: printable bytes stand for themselves, the rest map above 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _add_tokenizer(writer: GGUFWriter) -> int:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols(), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * 257)
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    return len(tokens)


def _matrix(
    kind: str, rows: int, cols: int, rng: np.random.Generator
) -> tuple[np.ndarray, GGMLQuantizationType]:
    if kind == "F16":
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16), GGMLQuantizationType.F16
    packed = random_packed(kind, rows, cols, rng)
    return packed.data, GGMLQuantizationType(packed.qtype)


def write_tiny_gguf(path: Path, seed: int = 0, layer_formats: list[dict[str, str]] = LAYER_FORMATS) -> Path:
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(len(layer_formats))
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = _add_tokenizer(writer)
    writer.add_vocab_size(vocab)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        data, qtype = _matrix(kind, rows, cols, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", "Q4_0", vocab, HIDDEN)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
              "ffn_down": (HIDDEN, INTERMEDIATE)}  # fmt: skip
    for layer, formats in enumerate(layer_formats):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            )
        for kind, (rows, cols) in shapes.items():
            add(f"blk.{layer}.{kind}.weight", formats[kind], rows, cols)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    add("output.weight", "Q6_K", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
