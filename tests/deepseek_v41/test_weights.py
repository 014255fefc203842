"""DeepSeek-V4.1 checkpoints: the tiny random one loads, quantized tensors dequantize as the
formulas and DeepSeek's own reference code say, and each broken tensor is named."""

from __future__ import annotations

import ast
import json
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_weights import load_v41_weights
from tests.deepseek_v41.reference import ENGINE_SDIST, TILE_KERNELS_WHEEL, reference_file
from tests.deepseek_v41.tiny_v41 import E2M1, TinyV41, build_v41, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyV41:
    return build_v41(tmp_path_factory.mktemp("v41_tiny"), tiny_config(), seed=0)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_v41_weights(tiny.path, DeepseekV41Arch.from_file(tiny.path))


def test_tiny_checkpoint_loads_every_tensor(tiny, loaded):
    engram = {name for name in tiny.values if name.endswith("engram.embed.weight")}
    vision = {name for name in tiny.values if name.startswith(("vision.", "aligner."))}
    assert set(loaded.tensors) == set(tiny.values) - engram - vision
    assert {v.dtype for v in loaded.tensors.values()} == {torch.float32}
    assert [n for n, v in loaded.tensors.items() if not torch.equal(v, tiny.values[n])] == []
    assert set(loaded.engram_tables) == {1, 4}
    for layer, table in loaded.engram_tables.items():
        expected = tiny.values[f"layers.{layer}.engram.embed.weight"]
        rows = torch.tensor([[0, 5], [len(expected) - 1, 17]])
        assert torch.equal(table.lookup(rows), expected[rows])
    assert set(loaded.vision) == vision
    assert [n for n, v in loaded.vision.items() if not torch.equal(v, tiny.values[n])] == []
    assert {v.dtype for v in loaded.vision.values()} == {torch.float32}


def test_layer_kinds_hold_their_own_tensors(loaded):
    names = loaded.tensors
    # Compressors only where the compressed KV is owned (1: C2 with a gate, 3: C1 without).
    owners = {int(n.split(".")[1]) for n in names if ".compressor.wkv." in n}
    assert owners == {1, 3}
    assert "layers.1.attn.compressor.wgate.weight" in names
    assert "layers.3.attn.compressor.wgate.weight" not in names
    # Own top-k in 1, 2, 3, 5; index keys only in the index-K sources 1 and 3.
    assert {int(n.split(".")[1]) for n in names if ".indexer.wq_b." in n} == {1, 2, 3, 5}
    assert {int(n.split(".")[1]) for n in names if ".indexer.wk." in n} == {1, 3}
    assert not any(n.startswith("layers.0.attn.indexer") for n in names)  # sliding only
    # DSpark: the draft layers' own 2 experts, target projection first, heads last.
    assert {n for n in names if n.startswith("mtp.0.ffn.experts.")} == {
        f"mtp.0.ffn.experts.{e}.w{k}.weight" for e in range(2) for k in (1, 2, 3)
    }
    assert names["mtp.0.main_proj.weight"].shape == (64, 2 * 64)
    assert names["mtp.1.confidence_head.proj.weight"].shape == (1, 64 + 8)
    assert "mtp.1.main_proj.weight" not in names and "mtp.0.markov_head.embed.weight" not in names
    assert not any("hc_head" in n for n in names)  # shifted hyper-connections: no head mixer
    assert names["layers.4.engram.wkv.weight"].shape == (64 * 3, 2 * 32 * 2)


def test_engram_tables_stay_mapped_from_the_checkpoint(tiny, loaded):
    shards = {str(p.resolve()) for p in tiny.path.glob("*.safetensors")}
    for table in loaded.engram_tables.values():
        assert table.weight.dtype == torch.float8_e4m3fn
        assert _mapped_file(table.weight.data_ptr()) in shards
        assert _mapped_file(table.scale.data_ptr()) in shards


def _mapped_file(address: int) -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else None
    return None


def _fp8_by_blocks(codes: torch.Tensor, scale_bytes: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Each 32x32 block times 2^(its scale byte - 127), one block at a time."""
    out = torch.empty(codes.shape)
    for i in range(scale_bytes.shape[0]):
        for j in range(scale_bytes.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = codes[rows, cols].float() * 2.0 ** (int(scale_bytes[i, j]) - 127)
    return out


def _fp4_by_element(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Byte k of a row holds inputs 2k (low nibble) and 2k + 1; one scale per 32 inputs."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half)
    data = packed.view(torch.uint8)
    for r in range(rows):
        for k in range(half):
            byte = int(data[r, k])
            for col, code in ((2 * k, byte & 0xF), (2 * k + 1, byte >> 4)):
                out[r, col] = float(E2M1[code]) * 2.0 ** (int(scale_bytes[r, col // 32]) - 127)
    return out


def test_dequantization_matches_the_formulas(tiny, loaded):
    for name in ("layers.0.attn.wq_b.weight", "layers.4.engram.wkv.weight", "mtp.0.main_proj.weight"):
        codes, scale = tiny.quantized[name]
        assert torch.equal(loaded.tensors[name], _fp8_by_blocks(codes, scale)), name
    for name in ("layers.2.ffn.experts.3.w2.weight", "mtp.1.ffn.experts.0.w1.weight"):
        packed, scale = tiny.quantized[name]
        assert torch.equal(loaded.tensors[name], _fp4_by_element(packed, scale)), name


def _reference_function(source: Path, name: str) -> Callable:
    """One pure-PyTorch function of DeepSeek's code, compiled from its file alone: the modules
    around it import GPU kernel languages that are not installed here."""
    tree = ast.parse(source.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(source), "exec"), namespace)
    return namespace[name]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Callable]:
    """DeepSeek's UE8M0 decoder (engine's HF loader) and e2m1 unpacker (TileKernels)."""
    root = tmp_path_factory.mktemp("v41_reference")
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        tar.extract("deepinfer-0.1.0/deepinfer/hugging_face/weights.py", root, filter="data")
    with zipfile.ZipFile(reference_file(TILE_KERNELS_WHEEL)) as wheel:
        wheel.extract("tile_kernels/quant/common.py", root)
    return {
        "ue8m0": _reference_function(
            root / "deepinfer-0.1.0/deepinfer/hugging_face/weights.py", "_ue8m0_to_fp32"
        ),
        "e2m1": _reference_function(root / "tile_kernels/quant/common.py", "unpack_from_e2m1fn_x2"),
    }


def test_dequantization_matches_deepseeks_reference(tiny, loaded, reference):
    ue8m0, e2m1 = reference["ue8m0"], reference["e2m1"]
    for name in ("layers.1.attn.wkv.weight", "layers.1.ffn.shared_experts.w2.weight"):
        codes, scale = tiny.quantized[name]
        rows, cols = codes.shape
        scale = ue8m0(scale.view(torch.float8_e8m0fnu))
        full = scale.repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
        assert torch.equal(loaded.tensors[name], codes.float() * full), name
    for name in ("layers.0.ffn.experts.0.w1.weight", "layers.5.ffn.experts.2.w2.weight"):
        packed, scale = tiny.quantized[name]
        expected = e2m1(packed) * ue8m0(scale.view(torch.float8_e8m0fnu)).repeat_interleave(32, 1)
        assert torch.equal(loaded.tensors[name], expected), name


def test_model_prefix_and_text_only_checkpoints(tiny, tmp_path):
    stored = {f"model.{name}": t for name, t in tiny.stored.items()}
    write_checkpoint(tmp_path, tiny.config, stored)
    weights = load_v41_weights(tmp_path, DeepseekV41Arch.from_file(tmp_path))
    assert "embed.weight" in weights.tensors and "vision.norm.weight" in weights.vision
    text_only = {n: t for n, t in tiny.stored.items() if not n.startswith(("vision.", "aligner."))}
    write_checkpoint(tmp_path, tiny.config, text_only)
    assert load_v41_weights(tmp_path, DeepseekV41Arch.from_file(tmp_path)).vision == {}


def _drop(name: str):
    return lambda s: s.pop(name)


def _put(name: str, tensor: torch.Tensor):
    return lambda s: s.__setitem__(name, tensor)


def _retype(name: str, dtype: torch.dtype):
    return lambda s: s.__setitem__(name, s[name].float().to(dtype))


BF16 = torch.bfloat16
BROKEN = [
    (
        "missing gate",
        _drop("layers.1.attn.compressor.wgate.weight"),
        r"missing.*layers\.1\.attn\.compressor\.wgate",
    ),
    ("missing expert", _drop("layers.5.ffn.experts.3.w2.weight"), r"missing.*layers\.5\.ffn\.experts\.3\.w2"),
    ("missing scale", _drop("layers.0.attn.wq_a.scale"), r"layers\.0\.attn\.wq_a\.weight: its scale"),
    (
        "consumer compressor",
        _put("layers.2.attn.compressor.wkv.weight", torch.zeros(96, 64, dtype=BF16)),
        "unexpected",
    ),
    (
        "C1 gate",
        _put("layers.3.attn.compressor.wgate.weight", torch.zeros(96, 64, dtype=BF16)),
        r"layers\.3\.attn",
    ),
    (
        "shared keys",
        _put("layers.2.attn.indexer.wk.weight", torch.zeros(64, 96, dtype=BF16)),
        r"layers\.2\.attn\.ind",
    ),
    (
        "extra DSpark",
        _put("mtp.2.attn_norm.weight", torch.zeros(64, dtype=BF16)),
        r"unexpected.*mtp\.2\.attn_norm",
    ),
    (
        "orphan scale",
        _put("layers.0.attn_norm.scale", torch.zeros(2, dtype=torch.uint8)),
        r"layers\.0\.attn_norm\.sc",
    ),
    (
        "unfolded hc",
        _put("layers.0.hc_attn_norm.weight", torch.ones(128)),
        r"layers\.0\.hc_attn_norm\.weight",
    ),
    (
        "duplicate",
        _put("model.embed.weight", torch.zeros(96, 64, dtype=BF16)),
        r"embed\.weight: in the checkpoint twice",
    ),
    ("hc in bf16", _retype("layers.2.hc_ffn_fn", BF16), r"layers\.2\.hc_ffn_fn: stored as torch\.bfloat16"),
    ("sink in bf16", _retype("mtp.0.attn.attn_sink", BF16), r"mtp\.0\.attn\.attn_sink: stored as"),
    ("fp8 as bf16", _retype("layers.4.attn.wo_b.weight", BF16), r"layers\.4\.attn\.wo_b\.weight: stored as"),
    (
        "scale as f32",
        _retype("layers.4.attn.wo_b.scale", torch.float32),
        r"layers\.4\.attn\.wo_b\.scale: scales are",
    ),
    (
        "fp8 shape",
        _put("layers.4.attn.wkv.weight", torch.zeros(95, 64).to(torch.float8_e4m3fn)),
        r"layers\.4\.attn\.wkv\.weight: shape \(95, 64\), expected \(96, 64\)",
    ),
    (
        "fp8 scale shape",
        _put("layers.4.attn.wkv.scale", torch.zeros(3, 3, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
        r"layers\.4\.attn\.wkv\.scale: shape \(3, 3\), expected \(3, 2\)",
    ),
    (
        "fp4 shape",
        _put("layers.0.ffn.experts.1.w3.weight", torch.zeros(32, 64, dtype=torch.int8)),
        r"layers\.0\.ffn\.experts\.1\.w3\.weight: shape \(32, 64\), expected \(32, 32\)",
    ),
    (
        "engram rows",
        _put("layers.4.engram.embed.weight", torch.zeros(10, 32).to(torch.float8_e4m3fn)),
        r"layers\.4\.engram\.embed\.weight: shape \(10, 32\)",
    ),
    (
        "norm shape",
        _put("layers.3.attn.kv_norm.weight", torch.zeros(64, dtype=BF16)),
        r"layers\.3\.attn\.kv_norm",
    ),
]


@pytest.mark.parametrize(("mutate", "message"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_checkpoint_names_the_tensor(tiny, tmp_path, mutate, message):
    stored = dict(tiny.stored)
    mutate(stored)
    write_checkpoint(tmp_path, tiny.config, stored)
    with pytest.raises(ValueError, match=message):
        load_v41_weights(tmp_path, DeepseekV41Arch.from_file(tmp_path))


def test_config_that_does_not_match_the_checkpoint(tiny):
    unshifted = tiny_config(hc_shifted=False)
    with pytest.raises(ValueError, match=r"missing.*hc_head_base"):
        load_v41_weights(tiny.path, DeepseekV41Arch.from_raw(unshifted))


def test_index_that_does_not_match_its_shards(tiny, tmp_path):
    write_checkpoint(tmp_path, tiny.config, dict(tiny.stored))
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["norm.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"norm\.weight: model\.safetensors\.index\.json places it in"):
        load_v41_weights(tmp_path, DeepseekV41Arch.from_file(tmp_path))
    index["weight_map"]["extra.weight"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00009-of-00009"):
        load_v41_weights(tmp_path, DeepseekV41Arch.from_file(tmp_path))
