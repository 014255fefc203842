from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from deepinfer.store import FORMAT_VERSION, decode_object, encode_object
from deepinfer.store.objects import FIXED_SIZE, CorruptObject, ForeignObject, ForgedObject
from deepinfer.store.seal import ChunkSeal

KEY = bytes(range(32))
NS = b"model:abc|salt:tenant-1"


def _encode(array, key=KEY, ns=NS, cls="chat", tokens=16) -> bytes:
    return b"".join(bytes(p) for p in encode_object(key, ns, cls, tokens, array))


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint16", "int8", "bool", "complex64"])
def test_round_trip_is_bit_exact(dtype: str) -> None:
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 2, 16, 4, 8)) * 10).astype(dtype)
    decoded = decode_object(_encode(array, tokens=16), KEY, NS)
    assert decoded.array.dtype == array.dtype
    assert decoded.array.shape == array.shape
    assert decoded.array.tobytes() == array.tobytes()
    assert decoded.header.num_tokens == 16
    assert decoded.header.traffic_class == "chat"
    assert decoded.header.namespace == NS


def test_non_contiguous_and_nan_payloads_survive() -> None:
    base = np.arange(64, dtype=np.float32).reshape(8, 8)
    base[0, 0] = np.nan
    view = base[:, ::2]
    decoded = decode_object(_encode(view), KEY, NS)
    assert decoded.array.tobytes() == np.ascontiguousarray(view).tobytes()


def test_bytes_payload_becomes_uint8() -> None:
    decoded = decode_object(_encode(np.frombuffer(b"\x00\xffraw", dtype=np.uint8)), KEY, NS)
    assert decoded.array.tobytes() == b"\x00\xffraw"


def test_unsupported_dtype_is_rejected_at_encode() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_object(KEY, NS, "chat", 1, np.array([object()], dtype=object))


@pytest.mark.parametrize("keep", [0, 3, FIXED_SIZE - 1, FIXED_SIZE + 5, -1])
def test_truncation_anywhere_is_corrupt(keep: int) -> None:
    data = _encode(np.ones((4, 16), np.float16))
    with pytest.raises(CorruptObject, match="truncated"):
        decode_object(data[:keep], KEY, NS)


def test_every_single_flipped_byte_past_the_version_is_detected() -> None:
    data = bytearray(_encode(np.arange(40, dtype=np.float16)))
    for pos in range(6, len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        with pytest.raises((CorruptObject, ForeignObject)):
            decode_object(damaged, KEY, NS)


def test_flipped_payload_byte_fails_the_checksum() -> None:
    data = bytearray(_encode(np.arange(40, dtype=np.float16)))
    data[-7] ^= 0x80
    with pytest.raises(CorruptObject, match="checksum"):
        decode_object(data, KEY, NS)


def test_wrong_version_is_foreign() -> None:
    data = bytearray(_encode(np.zeros(8, np.float32)))
    struct.pack_into("<H", data, 4, FORMAT_VERSION + 1)
    with pytest.raises(ForeignObject, match="version"):
        decode_object(data, KEY, NS)


def test_bad_magic_is_corrupt() -> None:
    data = bytearray(_encode(np.zeros(8, np.float32)))
    data[0:4] = b"NOPE"
    with pytest.raises(CorruptObject, match="magic"):
        decode_object(data, KEY, NS)


def test_other_key_or_namespace_is_foreign() -> None:
    data = _encode(np.zeros(8, np.float32))
    with pytest.raises(ForeignObject, match="key"):
        decode_object(data, bytes(32), NS)
    with pytest.raises(ForeignObject, match="namespace"):
        decode_object(data, KEY, b"model:other|salt:tenant-1")
    with pytest.raises(ForeignObject, match="namespace"):
        decode_object(data, KEY, b"model:abc|salt:tenant-2")


def test_consistent_checksum_over_a_lying_shape_is_still_caught() -> None:
    # A writer bug (header shape disagreeing with the payload) must not produce a wrong view.
    array = np.zeros(8, np.float32)
    prefix, payload = encode_object(KEY, NS, "chat", 1, array)
    prefix = bytearray(prefix)
    struct.pack_into("<Q", prefix, len(prefix) - 8, 9)  # shape (9,) for 8 floats
    header = bytes(prefix[FIXED_SIZE:])
    struct.pack_into("<I", prefix, FIXED_SIZE - 4, zlib.crc32(bytes(payload), zlib.crc32(header)))
    with pytest.raises(CorruptObject, match="shape"):
        decode_object(bytes(prefix) + bytes(payload), KEY, NS)


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes-gcm"])
def test_sealed_objects_round_trip_and_every_flipped_byte_is_refused(encrypt: bool) -> None:
    seal = ChunkSeal(b"c" * 32, encrypt=encrypt)
    array = np.arange(40, dtype=np.float16)
    data = b"".join(bytes(p) for p in encode_object(KEY, NS, "chat", 16, array, seal))
    assert np.array_equal(decode_object(data, KEY, NS, seal).array, array)
    for pos in range(6, len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        with pytest.raises((CorruptObject, ForeignObject, ForgedObject)):
            decode_object(damaged, KEY, NS, seal)


def test_a_keyed_reader_refuses_an_unsealed_object_and_a_keyless_one_a_sealed_one() -> None:
    array = np.arange(40, dtype=np.float16)
    with pytest.raises(ForgedObject, match="unauthenticated"):
        decode_object(_encode(array), KEY, NS, ChunkSeal(b"c" * 32))
    sealed = b"".join(bytes(p) for p in encode_object(KEY, NS, "chat", 16, array, ChunkSeal(b"c" * 32)))
    with pytest.raises(ForeignObject, match="cluster key"):
        decode_object(sealed, KEY, NS)
