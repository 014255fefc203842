"""The stored object: a self-describing header followed by one chunk's KV payload.

Layout (little-endian):

    magic b"DIKV" | version u16 | header_len u32 | payload_len u64 | crc32 u32
    header: key (u16 len + bytes) | namespace (u16 len + bytes) | traffic class (u8 len + ascii)
            | num_tokens u32 | dtype (u8 len + numpy dtype.str) | ndim u8 | shape (u64 each)
    payload: payload_len bytes, C order

The CRC covers the variable header and the payload, so a flipped byte anywhere past the fixed
prefix, or a truncated object, is detected. CRC-32 (zlib.crc32, the IEEE polynomial, not
CRC-32C) was chosen over SHA-256/BLAKE2: the threat is accidental damage (torn or partial
writes, bit rot, a truncated copy), not an adversary -- anyone who can write to the store can
also write a matching digest -- and the check sits on the load path that gates time to first
token, where CRC-32 runs about 2.5x faster than SHA-256 and 4x faster than BLAKE2b here
(4.3 vs 1.7 vs 1.1 GB/s), releasing the GIL on large buffers like the hashes do. It misses a
random corruption with probability 2**-32 and every burst of up to 32 bits.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = b"DIKV"
FORMAT_VERSION = 1

_FIXED = struct.Struct("<4sHIQI")
FIXED_SIZE = _FIXED.size
# Only plain numeric kinds: object or void dtypes cannot be rebuilt from raw bytes.
# bfloat16 travels as a uint16 view; the namespace (which includes the KV dtype) says how to read it.
_PAYLOAD_KINDS = frozenset("biufc")


class InvalidObject(ValueError):
    """The bytes are not a usable object for this key; the caller treats it as a miss."""


class CorruptObject(InvalidObject):
    """Damaged bytes: truncated, bad magic or checksum, inconsistent sizes."""


class ForeignObject(InvalidObject):
    """An intact object that is not ours: another format version, key or namespace."""


@dataclass(slots=True, frozen=True)
class ObjectHeader:
    key: bytes
    namespace: bytes
    traffic_class: str
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class DecodedObject:
    header: ObjectHeader
    array: np.ndarray


def as_payload_array(payload: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    """Bytes become a flat uint8 array; arrays must have a plain numeric dtype."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return np.frombuffer(payload, dtype=np.uint8)
    if not isinstance(payload, np.ndarray):
        raise TypeError(f"payload must be a numpy array or bytes, got {type(payload).__name__}")
    if payload.dtype.kind not in _PAYLOAD_KINDS:
        raise ValueError(
            f"payload dtype {payload.dtype} is not a plain numeric dtype (pass bfloat16 as a uint16 view)"
        )
    return payload


def _pack_header(header: ObjectHeader) -> bytes:
    cls = header.traffic_class.encode("ascii")
    dtype = header.dtype.encode("ascii")
    parts = [
        struct.pack("<H", len(header.key)),
        header.key,
        struct.pack("<H", len(header.namespace)),
        header.namespace,
        struct.pack("<B", len(cls)),
        cls,
        struct.pack("<IB", header.num_tokens, len(dtype)),
        dtype,
        struct.pack(f"<B{len(header.shape)}Q", len(header.shape), *header.shape),
    ]
    return b"".join(parts)


def encode_object(
    key: bytes, namespace: bytes, traffic_class: str, num_tokens: int, array: np.ndarray
) -> list[bytes | memoryview]:
    """Serialize to parts (prefix+header, payload) so a file writer avoids copying the payload."""
    array = np.ascontiguousarray(as_payload_array(array))
    header = ObjectHeader(key, namespace, traffic_class, num_tokens, array.dtype.str, tuple(array.shape))
    header_bytes = _pack_header(header)
    payload = memoryview(array.reshape(-1).view(np.uint8))
    crc = zlib.crc32(payload, zlib.crc32(header_bytes))
    prefix = _FIXED.pack(MAGIC, FORMAT_VERSION, len(header_bytes), payload.nbytes, crc)
    return [prefix + header_bytes, payload]


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def take_bytes(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CorruptObject("header field runs past the header")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out


def _unpack_header(data: memoryview) -> ObjectHeader:
    reader = _Reader(data)
    try:
        key = reader.take_bytes(reader.take("<H")[0])
        namespace = reader.take_bytes(reader.take("<H")[0])
        traffic_class = reader.take_bytes(reader.take("<B")[0]).decode("ascii")
        num_tokens, dtype_len = reader.take("<IB")
        dtype = reader.take_bytes(dtype_len).decode("ascii")
        (ndim,) = reader.take("<B")
        shape = reader.take(f"<{ndim}Q")
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptObject(f"unreadable header: {exc}") from None
    if reader.pos != len(data):
        raise CorruptObject("header has trailing bytes")
    return ObjectHeader(key, namespace, traffic_class, num_tokens, dtype, tuple(shape))


def decode_object(data: bytes | bytearray | memoryview, key: bytes, namespace: bytes) -> DecodedObject:
    """Validate everything, then view the payload without copying; raise InvalidObject otherwise."""
    view = memoryview(data).cast("B")
    if len(view) < FIXED_SIZE:
        raise CorruptObject(f"truncated: {len(view)} bytes, less than the fixed prefix")
    magic, version, header_len, payload_len, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if version != FORMAT_VERSION:
        raise ForeignObject(f"format version {version}, this engine reads {FORMAT_VERSION}")
    expected = FIXED_SIZE + header_len + payload_len
    if len(view) < expected:
        raise CorruptObject(f"truncated: {len(view)} of {expected} bytes")
    if len(view) > expected:
        raise CorruptObject(f"{len(view) - expected} trailing bytes")
    header_view = view[FIXED_SIZE : FIXED_SIZE + header_len]
    payload = view[FIXED_SIZE + header_len :]
    if zlib.crc32(payload, zlib.crc32(header_view)) != crc:
        raise CorruptObject("checksum mismatch")
    header = _unpack_header(header_view)
    if header.key != key:
        raise ForeignObject("object belongs to another key")
    if header.namespace != namespace:
        raise ForeignObject("object belongs to another namespace (model or cache salt)")
    try:
        dtype = np.dtype(header.dtype)
    except TypeError:
        raise CorruptObject(f"unknown dtype {header.dtype!r}") from None
    if dtype.kind not in _PAYLOAD_KINDS:
        raise CorruptObject(f"dtype {header.dtype!r} is not a payload dtype")
    if int(np.prod(header.shape, dtype=np.int64)) * dtype.itemsize != payload_len:
        raise CorruptObject("shape and dtype do not match the payload size")
    return DecodedObject(header, np.frombuffer(payload, dtype=dtype).reshape(header.shape))
