"""The tensor table of a GGUF file, each tensor a view of one read-only memory map.

`gguf.GGUFReader` decodes every metadata value into Python objects, which for a tokenizer of
50k tokens and merges takes seconds; starting a model needs only the tensor records, so the
metadata is skipped here by its lengths alone. Layout (GGUF v2/v3, little-endian): magic, version,
tensor count, metadata count, metadata (key, type, value), tensor infos (name, dims, type, offset),
then the tensor data at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by value type
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the memory map

    @property
    def rows(self) -> int:
        return self.data.shape[0]


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.offset = memoryview(buffer), 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        text = bytes(self.buffer[self.offset : self.offset + length]).decode()
        self.offset += length
        return text

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            (length,) = self.unpack("<Q")
            self.offset += length
        elif kind == _ARRAY:
            item, count = self.unpack("<IQ")
            if item in _SCALAR_BYTES:
                self.offset += count * _SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SCALAR_BYTES:
            self.offset += _SCALAR_BYTES[kind]
        else:
            raise ValueError(f"unknown GGUF metadata value type {kind}")


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor of the file, in file order, without reading their data."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(mapped)
    magic, version, tensor_count, kv_count = cursor.unpack("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    alignment = 32
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        if key == "general.alignment" and kind == _UINT32:
            (alignment,) = cursor.unpack("<I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        (n_dims,) = cursor.unpack("<I")
        shape = cursor.unpack(f"<{n_dims}Q")
        kind, offset = cursor.unpack("<IQ")
        infos.append((name, GGMLQuantizationType(kind), shape, offset))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, kind, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * size
        rows = int(np.prod(shape[1:], dtype=np.int64))
        data = mapped[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, kind, tuple(shape), data))
    return tensors
