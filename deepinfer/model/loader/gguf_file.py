"""Read a GGUF file: HF-style config, HF-named weights, tokenizer metadata.

Weights come either dequantized to fp32 or, for the block formats the native kernels compute on,
as packed blocks: a view of the file's memory map, never converted. Dequantizing goes through the
kernels' row decoder for their formats (the `gguf` package's values, bit for bit, on every core)
and through the `gguf` package for the others, a slice of rows at a time; a format neither reads
is refused before any weight is converted, naming the tensor and its type.
llama.cpp stores the Q and K projections of the `llama` architecture permuted for its interleaved
RoPE; they are permuted back to the HF "rotate half" layout here (whole rows, so packed blocks
are reordered, not decoded), so one model implementation serves both sources.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from deepinfer.kernels.gguf_blocks import PACKED_TYPES, PackedMatrix, gguf_kernels
from deepinfer.model.loader.gguf_tensors import GGUFTensor

# Rows per `gguf` package call: its temporaries are several times a slice's fp32 size, so a
# 128k-row embedding is never expanded whole.
_SLICE_ROWS = 4096

_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH_TO_MODEL_TYPE)}")

    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "model_type": _ARCH_TO_MODEL_TYPE[arch],
        "vocab_size": int(a("vocab_size", len(tokens.data) if tokens else 0)),
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling_type = a("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(a("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(a("rope.scaling.original_context_length", 0)),
        }
    return config


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs back to rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor (KeyError for tensors no supported model has)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def _permuted_heads(gguf_name: str, config: dict[str, Any]) -> int | None:
    """The head count whose row permutation llama.cpp applied to this tensor, if any."""
    if config["model_type"] != "llama":
        return None
    if gguf_name.endswith(".attn_q.weight") or gguf_name.endswith(".attn_q.bias"):
        return config["num_attention_heads"]
    if gguf_name.endswith(".attn_k.weight") or gguf_name.endswith(".attn_k.bias"):
        return config["num_key_value_heads"]
    return None


def check_readable(tensor: GGUFTensor) -> None:
    """Raise a ValueError naming the tensor and its type when no path here reads its format."""
    from gguf import quants

    if tensor.tensor_type.name in PACKED_TYPES:
        return
    try:
        quants.dequantize(tensor.data[:1], tensor.tensor_type)  # one row: asks the package, cheaply
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, a type DeepInfer cannot "
            f"read (native kernels: {', '.join(PACKED_TYPES)}; the gguf package's dequantizers for the rest)"
        ) from None


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values, float32 [rows, row length]."""
    from gguf import quants

    kernels = gguf_kernels() if tensor.tensor_type.name in PACKED_TYPES else None
    if kernels is not None:
        matrix = PackedMatrix(int(tensor.tensor_type), tensor.rows, tensor.shape[0], tensor.data)
        return kernels.dequantize_rows(matrix, torch.arange(tensor.rows)).numpy()
    check_readable(tensor)
    out = np.empty((tensor.rows, tensor.shape[0]), dtype=np.float32)
    for start in range(0, tensor.rows, _SLICE_ROWS):
        rows = tensor.data[start : start + _SLICE_ROWS]
        out[start : start + len(rows)] = quants.dequantize(rows, tensor.tensor_type).reshape(len(rows), -1)
    return out


def iter_weights(
    tensors: Iterable[GGUFTensor], config: dict[str, Any], packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | PackedMatrix]]:
    """Yield (HF name, weight) for every tensor (gguf_tensors.read_tensors): an fp32 tensor, or
    with `packed` a PackedMatrix for 2-D tensors in a format of PACKED_TYPES. A tensor in a format
    nothing reads is refused before the first weight is yielded."""
    tensors = list(tensors)
    for tensor in tensors:
        check_readable(tensor)
    packable = set(PACKED_TYPES.values()) if packed else set()
    for tensor in tensors:
        name, heads = hf_name(tensor.name), _permuted_heads(tensor.name, config)
        if int(tensor.tensor_type) in packable and len(tensor.shape) == 2:
            blocks = tensor.data  # uint8 [rows, bytes per row], in the memory map
            if heads is not None:
                blocks = np.ascontiguousarray(_unpermute(blocks, heads))
            yield name, PackedMatrix(int(tensor.tensor_type), tensor.rows, tensor.shape[0], blocks)
            continue
        array = dequantize_tensor(tensor).reshape(tuple(reversed(tensor.shape)))
        if heads is not None:
            array = _unpermute(array, heads)
        yield name, torch.from_numpy(array)  # a fresh array: never the read-only map


def read_tokenizer_metadata(reader: Any) -> dict[str, Any]:
    return {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
