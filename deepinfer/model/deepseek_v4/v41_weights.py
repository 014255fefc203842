"""DeepSeek-V4.1 checkpoints: the HF tensor names of DeepSeek's release, checked and dequantized.

Names (optionally under `model.`), as DeepSeek's engine maps them:
- `embed.weight`, `image_start` / `image_end` / `image_newline`, `head.weight`, `norm.weight`,
  and `hc_head_{base,fn,scale}` only when hyper-connections are not shifted;
- per backbone layer `layers.{L}.`: `hc_{attn,ffn}_{base,fn,scale}`, `attn_norm` / `ffn_norm`,
  `attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b}`, `attn.attn_sink`; the compressor
  (`attn.compressor.{wkv, wgate (C2 only), norm}`) only in a layer that owns its compressed KV,
  the indexer (`attn.indexer.{wq_b, weights_proj}`) only in a layer that runs its own top-k, and
  its keys (`attn.indexer.{wk, k_norm}`) only in an index-K source; the MoE `ffn.gate.{weight,
  bias, bias_vl}` (the second bias routes image tokens), `ffn.shared_experts.w{1,2,3}` and
  per-expert `ffn.experts.{e}.w{1,2,3}`; on Engram layers `engram.{q_weight, k_weight, wkv,
  embed}`;
- per DSpark layer `mtp.{i}.`: the same block (sliding attention, its own expert count), the
  first with `main_proj` / `main_norm` (the projection of the target layers' features), the last
  with `norm`, `markov_head.{embed,head}`, `confidence_head.proj` (and `hc_head_*` unless
  shifted); embedding and head are the backbone's, stored once.
- `vision.*`: the ViT (`patch_embed.proj`, per block `blocks.{i}.{norm1, attn.wqkv, attn.wo,
  norm2, mlp.w1, mlp.w2}`, the final `norm`) and `aligner.{w1, w2}`: the projector to the LM's
  width; all of them or none (a text-only checkpoint).

Storage: FP8 e4m3 matrices with a UE8M0 scale (`X.scale`) per 32x32 block; routed experts FP4
e2m1 (two per byte, the even column in the low nibble) with a UE8M0 scale per 32 inputs; Engram
tables FP8 with a scale per row and 32 columns; hyper-connection mixers, sinks and routing
biases float32; the rest (the vision tower too) bfloat16.

Dequantized at load: this is a CPU float32 engine, where FP8 and FP4 matrix products have no
kernel and would be emulated by dequantizing on every step; dequantizing once costs memory, not
time. The Engram tables are the exception: they are by far the largest tensors and are read a
few rows per token, so they stay FP8, memory-mapped from the checkpoint (never copied), and the
rows a lookup gathers are dequantized then.

Every missing, unexpected, duplicated, mis-typed or mis-shaped tensor is an error naming it.
"""

from __future__ import annotations

import json
import math
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.model.deepseek_v4.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from deepinfer.model.deepseek_v4.v41_config import C2, DeepseekV41Arch
from deepinfer.model.layers.fp8 import dequantize_block_fp8

INDEX_FILE = "model.safetensors.index.json"
FP8, FP4, ENGRAM, FP32, FLOAT = "fp8", "fp4", "engram", "fp32", "float"
ENGRAM_SCALE_BLOCK = (1, 32)  # one scale per row and 32 columns
VISION_PREFIXES = ("vision.", "aligner.")
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SHOWN = 8
_HC_NORM = re.compile(r"(^|\.)hc_(attn|ffn|head)_norm\.weight$")


@dataclass(slots=True, frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # the logical (dequantized) shape
    storage: str  # FP8 | FP4 | ENGRAM | FP32 | FLOAT


@dataclass(slots=True, frozen=True)
class EngramTable:
    """One Engram layer's hashed table, FP8 rows mapped from the checkpoint."""

    weight: torch.Tensor  # [rows, head_dim] float8_e4m3fn, a view of the mapped shard
    scale: torch.Tensor  # [rows, head_dim / 32] float8_e8m0fnu, mapped too

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: int64 [...] -> float32 [..., head_dim]; reads only the gathered rows."""
        codes = self.weight.view(torch.uint8)[rows].view(torch.float8_e4m3fn)
        scales = self.scale.view(torch.uint8)[rows].view(torch.float8_e8m0fnu)
        return codes.float() * scales.float().repeat_interleave(ENGRAM_SCALE_BLOCK[1], dim=-1)


@dataclass(slots=True)
class V41Weights:
    tensors: dict[str, torch.Tensor]  # HF name (no `model.`) -> float32, dequantized
    engram_tables: dict[int, EngramTable]  # backbone layer -> its table
    vision: dict[str, torch.Tensor]  # vision tower, HF name -> float32; empty: a text-only checkpoint


def expected_tensors(arch: DeepseekV41Arch) -> dict[str, TensorSpec]:
    """Every tensor a V4.1 checkpoint of this architecture holds (scales aside), with its shape."""
    hidden, vocab, m = arch.hidden_size, arch.vocab_size, arch.hc_mult
    specs = {
        "embed.weight": TensorSpec((vocab, hidden), FLOAT),
        "head.weight": TensorSpec((vocab, hidden), FLOAT),
        "norm.weight": TensorSpec((hidden,), FLOAT),
        **{name: TensorSpec((hidden,), FLOAT) for name in ("image_start", "image_end", "image_newline")},
    }
    for layer in range(arch.num_layers):
        specs.update(_block(arch, f"layers.{layer}.", layer, arch.moe.num_experts))
    dspark = arch.dspark
    for depth in range(dspark.num_layers):
        prefix = f"mtp.{depth}."
        specs.update(_block(arch, prefix, arch.num_layers + depth, dspark.moe.num_experts))
        if depth == 0:
            targets = len(dspark.target_layer_ids)
            specs[prefix + "main_proj.weight"] = TensorSpec((hidden, targets * hidden), FP8)
            specs[prefix + "main_norm.weight"] = TensorSpec((hidden,), FLOAT)
        if depth == dspark.num_layers - 1:
            rank = dspark.markov_rank
            specs[prefix + "norm.weight"] = TensorSpec((hidden,), FLOAT)
            specs[prefix + "markov_head.embed.weight"] = TensorSpec((vocab, rank), FLOAT)
            specs[prefix + "markov_head.head.weight"] = TensorSpec((vocab, rank), FLOAT)
            specs[prefix + "confidence_head.proj.weight"] = TensorSpec((1, hidden + rank), FLOAT)
    if not arch.hc_shifted:
        # Shifted hyper-connections fold the head's stream mixing into the last block.
        heads = [""] + ([f"mtp.{dspark.num_layers - 1}."] if dspark.num_layers else [])
        for prefix in heads:
            specs[prefix + "hc_head_base"] = TensorSpec((m,), FP32)
            specs[prefix + "hc_head_fn"] = TensorSpec((m, m * hidden), FP32)
            specs[prefix + "hc_head_scale"] = TensorSpec((1,), FP32)
    return specs


def expected_vision_tensors(arch: DeepseekV41Arch) -> dict[str, TensorSpec]:
    """The vision tower's tensors: the ViT's linears with biases, its SwiGLUs without (`mlp.w1` is
    the gate and up projections stacked), and the two-layer projector from d x d merged patches."""
    v = arch.vision
    width, inter, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.downsample_ratio**2
    specs = {
        "vision.patch_embed.proj.weight": TensorSpec((width, 3 * v.patch_size**2), FLOAT),
        "vision.patch_embed.proj.bias": TensorSpec((width,), FLOAT),
        "vision.norm.weight": TensorSpec((width,), FLOAT),
        "aligner.w1.weight": TensorSpec((arch.hidden_size, merged), FLOAT),
        "aligner.w1.bias": TensorSpec((arch.hidden_size,), FLOAT),
        "aligner.w2.weight": TensorSpec((arch.hidden_size, arch.hidden_size), FLOAT),
        "aligner.w2.bias": TensorSpec((arch.hidden_size,), FLOAT),
    }
    for i in range(v.num_layers):
        block = f"vision.blocks.{i}."
        specs[block + "norm1.weight"] = TensorSpec((width,), FLOAT)
        specs[block + "attn.wqkv.weight"] = TensorSpec((3 * width, width), FLOAT)
        specs[block + "attn.wqkv.bias"] = TensorSpec((3 * width,), FLOAT)
        specs[block + "attn.wo.weight"] = TensorSpec((width, width), FLOAT)
        specs[block + "attn.wo.bias"] = TensorSpec((width,), FLOAT)
        specs[block + "norm2.weight"] = TensorSpec((width,), FLOAT)
        specs[block + "mlp.w1.weight"] = TensorSpec((2 * inter, width), FLOAT)
        specs[block + "mlp.w2.weight"] = TensorSpec((width, inter), FLOAT)
    return specs


def _block(arch: DeepseekV41Arch, prefix: str, layer: int, num_experts: int) -> dict[str, TensorSpec]:
    hidden, heads, head_dim, m = arch.hidden_size, arch.num_heads, arch.head_dim, arch.hc_mult
    mixes = (2 + m) * m  # pre (m) + post (m) + residual (m x m) mixing logits
    specs: dict[str, TensorSpec] = {}
    for kind in ("attn", "ffn"):
        specs[f"{prefix}hc_{kind}_base"] = TensorSpec((mixes,), FP32)
        specs[f"{prefix}hc_{kind}_fn"] = TensorSpec((mixes, m * hidden), FP32)
        specs[f"{prefix}hc_{kind}_scale"] = TensorSpec((3,), FP32)
    attn = prefix + "attn."
    o_rank = arch.o_groups * arch.o_lora_rank
    specs.update(
        {
            attn + "attn_sink": TensorSpec((heads,), FP32),
            attn + "wq_a.weight": TensorSpec((arch.q_lora_rank, hidden), FP8),
            attn + "q_norm.weight": TensorSpec((arch.q_lora_rank,), FLOAT),
            attn + "wq_b.weight": TensorSpec((heads * head_dim, arch.q_lora_rank), FP8),
            attn + "wkv.weight": TensorSpec((head_dim, hidden), FP8),
            attn + "kv_norm.weight": TensorSpec((head_dim,), FLOAT),
            # Grouped output: each group's heads (head_dim each) projected to o_lora_rank.
            attn + "wo_a.weight": TensorSpec((o_rank, head_dim * heads // arch.o_groups), FP8),
            attn + "wo_b.weight": TensorSpec((hidden, o_rank), FP8),
        }
    )
    if arch.owns_compressor(layer):
        specs[attn + "compressor.wkv.weight"] = TensorSpec((head_dim, hidden), FLOAT)
        if arch.compress_ratio(layer) == C2:  # C1's softmax over one token is 1: no gate
            specs[attn + "compressor.wgate.weight"] = TensorSpec((head_dim, hidden), FLOAT)
        specs[attn + "compressor.norm.weight"] = TensorSpec((head_dim,), FLOAT)
    if arch.owns_indexer(layer):
        index_width = arch.index_n_heads * arch.index_head_dim
        specs[attn + "indexer.wq_b.weight"] = TensorSpec((index_width, arch.q_lora_rank), FP8)
        specs[attn + "indexer.weights_proj.weight"] = TensorSpec((arch.index_n_heads, hidden), FLOAT)
        if arch.owns_index_keys(layer):
            # Index keys are projected from the compressor's pre-RoPE latent (head_dim wide).
            specs[attn + "indexer.wk.weight"] = TensorSpec((arch.index_head_dim, head_dim), FLOAT)
            specs[attn + "indexer.k_norm.weight"] = TensorSpec((arch.index_head_dim,), FLOAT)
    specs[prefix + "attn_norm.weight"] = TensorSpec((hidden,), FLOAT)
    specs[prefix + "ffn_norm.weight"] = TensorSpec((hidden,), FLOAT)
    ffn = prefix + "ffn."
    specs[ffn + "gate.weight"] = TensorSpec((num_experts, hidden), FLOAT)
    specs[ffn + "gate.bias"] = TensorSpec((num_experts,), FP32)
    specs[ffn + "gate.bias_vl"] = TensorSpec((num_experts,), FP32)
    if arch.moe.num_shared_experts:
        shared = arch.moe.intermediate_size * arch.moe.num_shared_experts
        specs[ffn + "shared_experts.w1.weight"] = TensorSpec((shared, hidden), FP8)
        specs[ffn + "shared_experts.w3.weight"] = TensorSpec((shared, hidden), FP8)
        specs[ffn + "shared_experts.w2.weight"] = TensorSpec((hidden, shared), FP8)
    inter = arch.moe.intermediate_size
    for expert in range(num_experts):
        specs[f"{ffn}experts.{expert}.w1.weight"] = TensorSpec((inter, hidden), FP4)
        specs[f"{ffn}experts.{expert}.w3.weight"] = TensorSpec((inter, hidden), FP4)
        specs[f"{ffn}experts.{expert}.w2.weight"] = TensorSpec((hidden, inter), FP4)
    engram = arch.engram
    if engram is not None and layer < arch.num_layers and layer in engram.layer_ids:
        tables = engram.max_ngram_size - 1
        specs[prefix + "engram.q_weight"] = TensorSpec((m, hidden), FLOAT)
        specs[prefix + "engram.k_weight"] = TensorSpec((m, hidden), FLOAT)
        # Fused value + per-stream key projection of the concatenated n-gram embeddings.
        per_table = engram.num_heads * engram.head_dim
        specs[prefix + "engram.wkv.weight"] = TensorSpec((hidden * (m + 1), per_table * tables), FP8)
        specs[prefix + "engram.embed.weight"] = TensorSpec(
            (engram.layer_rows(layer), engram.head_dim), ENGRAM
        )
    return specs


class MappedShards:
    """The safetensors shards of a directory, memory-mapped; tensors are views of the mapping."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.maps: dict[str, mmap.mmap] = {}
        self.entries: dict[str, tuple[str, dict]] = {}  # name (no `model.`) -> (shard, header entry)
        self.index: dict[str, str] | None = None  # the index file's name -> shard, when there is one
        shards = self._shards()
        for shard in shards:
            for raw_name, entry in self._header(shard).items():
                name = raw_name.removeprefix("model.")
                if name in self.entries:
                    raise ValueError(
                        f"{raw_name}: in the checkpoint twice ({self.entries[name][0]} and {shard})"
                    )
                self.entries[name] = (shard, entry)

    def _shards(self) -> list[str]:
        index_path = self.directory / INDEX_FILE
        if not index_path.exists():
            shards = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.directory}: no *.safetensors files")
            return shards
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (self.directory / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{self.directory}: shards named by {INDEX_FILE} are missing: {missing}")
        self.index = {name.removeprefix("model."): shard for name, shard in weight_map.items()}
        return shards

    def _header(self, shard: str) -> dict[str, dict]:
        path = self.directory / shard
        with path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: torch may view it writable
        size = int.from_bytes(mapped[:8], "little")
        if not 0 < size <= len(mapped) - 8:
            raise ValueError(f"{path}: not a safetensors file (header size {size})")
        header = json.loads(mapped[8 : 8 + size])
        header.pop("__metadata__", None)
        self.maps[shard] = mapped
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{name}: unsupported safetensors dtype {entry['dtype']}")
            if end - start != math.prod(entry["shape"]) * dtype.itemsize or 8 + size + end > len(mapped):
                raise ValueError(f"{name}: its byte range in {shard} does not match its shape")
            entry["base"] = 8 + size
        return header

    def check_index(self) -> None:
        if self.index is None:
            return
        for name, shard in self.index.items():
            if name not in self.entries or self.entries[name][0] != shard:
                raise ValueError(f"{name}: {INDEX_FILE} places it in {shard}, which does not hold it")
        unlisted = sorted(set(self.entries) - set(self.index))
        if unlisted:
            raise ValueError(f"tensors in the shards but not in {INDEX_FILE}: {_some(unlisted)}")

    def tensor(self, name: str) -> torch.Tensor:
        shard, entry = self.entries[name]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        start, end = entry["data_offsets"]
        if end == start:
            return torch.empty(entry["shape"], dtype=dtype)
        raw = torch.frombuffer(
            self.maps[shard], dtype=torch.uint8, count=end - start, offset=entry["base"] + start
        )
        return raw.view(dtype).reshape(entry["shape"])


def load_v41_weights(directory: str | Path, arch: DeepseekV41Arch) -> V41Weights:
    shards = MappedShards(Path(directory))
    shards.check_index()
    names = set(shards.entries)
    unfolded = sorted(n for n in names if _HC_NORM.search(n))
    if unfolded:
        raise ValueError(
            f"separate hyper-connection norm tensors {_some(unfolded)}: DeepSeek-V4.1 checkpoints fold them "
            "into hc_*_fn"
        )
    scales = {n for n in names if n.endswith(".scale")}
    vision_names = {n for n in names - scales if n.startswith(VISION_PREFIXES)}
    stored = names - scales - vision_names
    specs = expected_tensors(arch)
    missing = sorted(set(specs) - stored)
    if missing:
        raise ValueError(f"tensors missing from the checkpoint: {_some(missing)}")
    unexpected = sorted(stored - set(specs))
    if unexpected:
        raise ValueError(f"unexpected tensors for this DeepSeek-V4.1 config.json: {_some(unexpected)}")
    owners = {_scale_name(n): n for n in specs if specs[n].storage in (FP8, FP4, ENGRAM)}
    orphans = sorted(scales - set(owners))
    if orphans:
        raise ValueError(f"scales without a quantized weight: {_some(orphans)}")
    tensors: dict[str, torch.Tensor] = {}
    tables: dict[int, EngramTable] = {}
    for name, spec in specs.items():
        value = shards.tensor(name)
        if spec.storage in (FP8, FP4, ENGRAM):
            if _scale_name(name) not in scales:
                raise ValueError(f"{name}: its scale {_scale_name(name)} is missing")
            scale = shards.tensor(_scale_name(name))
            if scale.dtype != torch.float8_e8m0fnu:
                raise ValueError(f"{_scale_name(name)}: scales are UE8M0 (F8_E8M0), got {scale.dtype}")
        if spec.storage == ENGRAM:
            _check(name, value, spec.shape, (torch.float8_e4m3fn,))
            _check_scale(name, scale, (spec.shape[0], -(-spec.shape[1] // ENGRAM_SCALE_BLOCK[1])))
            tables[int(name.split(".")[1])] = EngramTable(value, scale)
        elif spec.storage == FP8:
            _check(name, value, spec.shape, (torch.float8_e4m3fn,))
            rows, cols = spec.shape
            block = arch.fp8_block
            _check_scale(name, scale, (-(-rows // block[0]), -(-cols // block[1])))
            tensors[name] = dequantize_block_fp8(value, scale.float(), block)
        elif spec.storage == FP4:
            rows, cols = spec.shape
            if cols % MXFP4_BLOCK:
                raise ValueError(f"{name}: FP4 experts need a multiple of {MXFP4_BLOCK} inputs, got {cols}")
            _check(name, value, (rows, cols // 2), (torch.int8, torch.uint8))
            _check_scale(name, scale, (rows, cols // MXFP4_BLOCK))
            tensors[name] = dequantize_mxfp4(value, scale)
        else:
            allowed = (torch.float32,) if spec.storage == FP32 else _FLOATS
            _check(name, value, spec.shape, allowed)
            tensors[name] = value.float() if value.dtype != torch.float32 else value.clone()
    vision = _load_vision(shards, arch, vision_names) if vision_names else {}
    return V41Weights(tensors=tensors, engram_tables=tables, vision=vision)


def load_v41_vision(directory: str | Path, arch: DeepseekV41Arch) -> dict[str, torch.Tensor]:
    """Only the vision tower (`vision.*`, `aligner.*`) and the LM's `image_start` / `image_newline`
    / `image_end`, float32, checked as load_v41_weights checks them: what an encode-role server
    needs, without reading (or dequantizing) the language model's tensors."""
    shards = MappedShards(Path(directory))
    shards.check_index()
    names = {n for n in shards.entries if n.startswith(VISION_PREFIXES) and not n.endswith(".scale")}
    if not names:
        raise ValueError("the checkpoint has no vision tower (no vision.* / aligner.* tensors)")
    tensors = _load_vision(shards, arch, names)
    for name in ("image_start", "image_newline", "image_end"):
        if name not in shards.entries:
            raise ValueError(f"tensors missing from the checkpoint: {[name]}")
        value = shards.tensor(name)
        _check(name, value, (arch.hidden_size,), _FLOATS)
        tensors[name] = value.float() if value.dtype != torch.float32 else value.clone()
    return tensors


def _load_vision(shards: MappedShards, arch: DeepseekV41Arch, names: set[str]) -> dict[str, torch.Tensor]:
    specs = expected_vision_tensors(arch)
    missing = sorted(set(specs) - names)
    if missing:
        raise ValueError(f"vision tensors missing from the checkpoint: {_some(missing)}")
    unexpected = sorted(names - set(specs))
    if unexpected:
        raise ValueError(
            f"unexpected vision tensors for this config.json's vision_config: {_some(unexpected)}"
        )
    tensors = {}
    for name, spec in specs.items():
        value = shards.tensor(name)
        _check(name, value, spec.shape, _FLOATS)
        tensors[name] = value.float() if value.dtype != torch.float32 else value.clone()
    return tensors


def _scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def _check(name: str, value: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if value.dtype not in dtypes:
        raise ValueError(f"{name}: stored as {value.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{name}: shape {tuple(value.shape)}, expected {tuple(shape)} (check config.json against the checkpoint)"
        )


def _check_scale(name: str, scale: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(scale.shape) != shape:
        raise ValueError(f"{_scale_name(name)}: shape {tuple(scale.shape)}, expected {shape} for {name}")


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{names[:_SHOWN]}{more}"
