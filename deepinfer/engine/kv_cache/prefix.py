"""Prefix hashes: the stable identity of a full block of KV.

hash(block) = sha256(parent_hash || token ids of the block || extra keys); the extra keys are the
content hashes of the images whose tokens the block holds (image_input.py). The chain starts from a
namespace root that folds in the model fingerprint (weights + tokenizer + KV dtype/layout) and the
request's cache salt, so the same tokens under another model or tenant never collide. SHA-256 over a
fixed little-endian encoding is stable across processes and restarts, which the persistent KV store
relies on (Python's `hash` is salted per process).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from deepinfer.image_input import ImageInput, image_extra_keys

HASH_BYTES = 32


def namespace_root(
    model_fingerprint: str, cache_salt: str | None = None, adapter: str | None = None
) -> bytes:
    """The parent hash of a sequence's first block."""
    h = hashlib.sha256(b"deepinfer-prefix-v1\0")
    for part in (model_fingerprint, cache_salt or "", adapter or ""):
        encoded = part.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def tenant_cache_salt(api_key: str, body_salt: str | None) -> str:
    """The cache salt of a request whose prefix cache is isolated per API key (a server with
    API keys, unless --shared-prefix-cache; a router computes the same to find the same hashes)."""
    tenant = hashlib.sha256(api_key.encode()).hexdigest()[:16]
    return f"key:{tenant}" if body_salt is None else f"key:{tenant}:{body_salt}"


def block_hash(parent: bytes, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(extra_keys)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    images: Sequence[ImageInput] = (),
) -> None:
    """Append the hashes of every full block of `token_ids` not yet hashed (in place). A block
    holding image tokens folds in those images' content hashes: its token ids are the same
    placeholder id for any picture."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else root
        start, end = i * block_size, (i + 1) * block_size
        extra = image_extra_keys(images, start, end) if images else b""
        hashes.append(block_hash(parent, token_ids[start:end], extra))
