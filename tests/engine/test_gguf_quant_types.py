"""The formats of Q5_K_M and Q3_K_M files on their native kernels, a format without one through the
dequantizing fallback, and a format nothing reads refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from deepinfer import LLM
from deepinfer.model.layers.gguf_linear import GGUFLinear
from deepinfer.model.layers.parallel_linear import ColumnParallelLinear
from deepinfer.model.loader.gguf_file import dequantize_tensor, iter_weights, read_config
from deepinfer.model.loader.gguf_tensors import read_tensors
from tests.engine.tiny_gguf import NEWER_LAYER_FORMATS, write_tiny_gguf


@pytest.fixture(scope="module")
def newer_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("newer-gguf") / "tiny-k-m.gguf"
    return write_tiny_gguf(path, seed=3, layer_formats=NEWER_LAYER_FORMATS)


def test_q5_and_q3_files_load_packed_and_match_their_dequantization(newer_gguf: Path) -> None:
    packed = LLM(model=str(newer_gguf), quantization="gguf", num_blocks=64)
    dense = LLM(model=str(newer_gguf), quantization="none", num_blocks=64)
    first, second = packed.engine.core.loaded.model.layers
    # every format interleaved eight rows at a time (100 + the ggml id)
    assert [m.qtype for m in first.self_attn.qkv_proj.group.matrices] == [113, 113, 114]  # Q5_K, Q6_K
    assert [m.qtype for m in first.mlp.gate_up_proj.group.matrices] == [111, 111]  # Q3_K
    assert first.self_attn.o_proj.group.matrices[0].qtype == 106  # Q5_0
    assert first.mlp.down_proj.group.matrices[0].qtype == 107  # Q5_1
    assert [m.qtype for m in second.mlp.gate_up_proj.group.matrices] == [106, 107]
    assert isinstance(second.mlp.down_proj, GGUFLinear)
    # a Q2_K member (no kernel): the fused q/k/v goes dense, its siblings dequantized into it
    assert isinstance(second.self_attn.qkv_proj, ColumnParallelLinear)
    ids = packed.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 3)
    ours, reference = packed.engine.core.score(ids), dense.engine.core.score(ids)
    assert ((ours - reference).norm() / reference.norm()).item() < 0.05


def test_the_dequantizing_fallback_equals_the_gguf_package(newer_gguf: Path) -> None:
    """Native formats through the kernels' row decoder, the rest through the package a slice of
    rows at a time: the package's values either way."""
    from gguf import quants

    for tensor in read_tensors(newer_gguf):
        expected = quants.dequantize(tensor.data, tensor.tensor_type).reshape(tensor.rows, -1)
        assert np.array_equal(dequantize_tensor(tensor), expected), tensor.name


def test_a_type_nothing_reads_is_refused_naming_the_tensor(tmp_path: Path, newer_gguf: Path) -> None:
    """Q8_1 (an activation format, never a weight in real files) has no dequantizer anywhere: the
    load stops before converting anything, with the tensor's name and type."""
    import gguf

    path = tmp_path / "q8_1.gguf"
    source = gguf.GGUFReader(str(newer_gguf))
    writer = GGUFWriter(str(path), "llama")
    for field in source.fields.values():
        if field.name.startswith(("llama.", "tokenizer.")):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in read_tensors(newer_gguf):
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        if tensor.name == "blk.1.ffn_down.weight":
            kind = GGMLQuantizationType.Q8_1
            block, size = GGML_QUANT_SIZES[kind]
            data = np.zeros((tensor.rows, tensor.shape[0] // block * size), dtype=np.uint8)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = read_config(gguf.GGUFReader(str(path)))
    for packed in (True, False):
        with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight' is stored as Q8_1"):
            next(iter_weights(read_tensors(path), config, packed=packed))
