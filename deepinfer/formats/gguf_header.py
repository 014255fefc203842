"""The metadata of a GGUF file, read with `struct` alone: scalars and strings by key, and where
each array lies so one item (a token's text) can be read without decoding the rest.

`gguf.GGUFReader` turns every value into numpy views (50k tokens and 50k merges for SmolLM2:
6-8 s of every server start, on a thread competing with the engine's own load); choosing a
recipe needs five values. Layout (GGUF v2/v3, little-endian): magic, version, tensor count,
metadata count, then each entry as key (u64 length + UTF-8), value type (u32), value; the tensor
infos follow the metadata.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class ArrayField:
    item_type: int
    count: int
    offset: int  # of the first item


@dataclass(slots=True)
class GGUFHeader:
    version: int
    tensor_count: int
    values: dict[str, Any] = field(default_factory=dict)  # scalar and string entries
    arrays: dict[str, ArrayField] = field(default_factory=dict)  # array entries, not decoded
    end: int = 0  # offset of the first tensor info

    def string_item(self, buffer: Any, key: str, index: int) -> str | None:
        """Item `index` of the string array `key` (None when there is no such item)."""
        found = self.arrays.get(key)
        if found is None or found.item_type != _STRING or not 0 <= index < found.count:
            return None
        cursor = Cursor(buffer, found.offset)
        for _ in range(index):
            cursor.skip(_STRING)
        return cursor.string()


class Cursor:
    """Reads little-endian GGUF values from a buffer (bytes, mmap or memoryview), advancing."""

    def __init__(self, buffer: Any, offset: int = 0) -> None:
        self.buffer, self.offset = buffer, offset

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        text = bytes(self.buffer[self.offset : self.offset + length]).decode()
        self.offset += length
        return text

    def skip(self, kind: int) -> None:
        if kind == _STRING:
            (length,) = self.unpack("<Q")
            self.offset += length
        elif kind == _ARRAY:
            self.skip_items(*self.unpack("<IQ"))
        elif kind in _SCALARS:
            self.offset += struct.calcsize(_SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF metadata value type {kind}")

    def skip_items(self, item: int, count: int) -> None:
        """Past `count` values of type `item` (an array's body)."""
        if item in _SCALARS:
            self.offset += count * struct.calcsize(_SCALARS[item])
        else:
            for _ in range(count):
                self.skip(item)


def parse_header(buffer: Any, name: str = "GGUF") -> GGUFHeader:
    """The header and metadata of a GGUF file held in `buffer` (`name` is for errors)."""
    cursor = Cursor(buffer)
    magic, version, tensor_count, kv_count = cursor.unpack("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{name}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    header = GGUFHeader(version, tensor_count)
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        if kind == _STRING:
            header.values[key] = cursor.string()
        elif kind in _SCALARS:
            (header.values[key],) = cursor.unpack(_SCALARS[kind])
        elif kind == _ARRAY:
            item, count = cursor.unpack("<IQ")
            header.arrays[key] = ArrayField(item, count, cursor.offset)
            cursor.skip_items(item, count)
        else:
            raise ValueError(f"{name}: unknown GGUF metadata value type {kind} for {key!r}")
    header.end = cursor.offset
    return header


def read_header(path: str | Path) -> tuple[GGUFHeader, dict[str, str]]:
    """The header of the file at `path`, and the texts of its bos/eos/unknown/padding tokens
    (by their `tokenizer.ggml.*_token_id`), read through a memory map."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        header = parse_header(mapped, str(path))
        special = {}
        for name in ("bos", "eos", "unknown", "padding"):
            token_id = header.values.get(f"tokenizer.ggml.{name}_token_id")
            if isinstance(token_id, int):
                text = header.string_item(mapped, "tokenizer.ggml.tokens", token_id)
                if text is not None:
                    special[name] = text
    return header, special
