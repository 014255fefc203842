"""The tensor table of a GGUF file, each tensor a view of one read-only memory map.

`gguf.GGUFReader` decodes every metadata value into Python objects, which for a tokenizer of
50k tokens and merges takes seconds; starting a model needs only the tensor records, so the
metadata is read by the recipe's header reader (arrays skipped by their lengths). After the
metadata: tensor infos (name, dims, type, offset), then the tensor data at the next multiple of
`general.alignment` (default 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from deepinfer.formats.gguf_header import Cursor, parse_header


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the memory map

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor of the file, in file order, without reading their data."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    header = parse_header(memoryview(mapped), str(path))
    cursor = Cursor(memoryview(mapped), header.end)
    alignment = header.values.get("general.alignment", 32)
    infos = []
    for _ in range(header.tensor_count):
        name = cursor.string()
        (n_dims,) = cursor.unpack("<I")
        shape = cursor.unpack(f"<{n_dims}Q")
        kind, offset = cursor.unpack("<IQ")
        try:
            infos.append((name, GGMLQuantizationType(kind), shape, offset))
        except ValueError:
            raise ValueError(
                f"{path}: GGUF tensor {name!r} has ggml type id {kind}, a type DeepInfer cannot read"
            ) from None
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, kind, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * size
        rows = int(np.prod(shape[1:], dtype=np.int64))
        data = mapped[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, kind, tuple(shape), data))
    return tensors
