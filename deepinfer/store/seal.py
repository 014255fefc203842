"""What vouches for a stored chunk: a CRC, a MAC keyed by the cluster secret, or AES-GCM.

Anyone who can write to the store can also write a matching CRC, so without a cluster key the
only guard against a forged chunk is who can reach the store: the directory is private to the
engine's user (0700, objects 0600) and a Redis store is as private as its network and password.
With a key (`--cluster-key-file`), every object carries an HMAC-SHA256 over its kind, its header
(chunk key, namespace, traffic class, token count, dtype, shape) and its payload, so a chunk
forged or moved to another key without the secret is refused; `--kv-store-encrypt` seals the
payload with AES-256-GCM instead (the header stays readable, and is authenticated), for stores
that other machines' administrators can read. Each job gets its own key, derived from the cluster
secret, so the store's key is never the one peers prove themselves with.

The kind is the object's format version (objects.py): 1 plain (what a keyless engine writes,
byte for byte the format before keys), 2 MAC, 3 AES-GCM. An engine with a key refuses kind 1
(a forger's easy way in); an engine without one cannot check kinds 2 and 3 and treats them as
another deployment's objects.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PLAIN = 1
MAC = 2
AEAD = 3
EXTRA_BYTES = {PLAIN: 0, MAC: hashlib.sha256().digest_size, AEAD: 12}  # the tag, or the nonce


class SealError(ValueError):
    """The object's MAC or AES-GCM tag does not verify: written without this cluster's key."""


def _derive(cluster_key: bytes, purpose: bytes) -> bytes:
    return hmac.new(cluster_key, b"deepinfer kv-store " + purpose, hashlib.sha256).digest()


class ChunkSeal:
    """How this engine writes chunks and which ones it accepts; `kind` is what it writes."""

    __slots__ = ("_aead", "_mac_key", "kind")

    def __init__(self, cluster_key: bytes | None = None, *, encrypt: bool = False) -> None:
        if encrypt and cluster_key is None:
            raise ValueError("kv_store_encrypt: encryption at rest needs --cluster-key-file")
        self._mac_key: bytes | None = None
        self._aead: AESGCM | None = None
        self.kind = PLAIN
        if cluster_key is not None:
            # Both keys whatever this engine writes: it reads what its peers wrote either way.
            self._mac_key = _derive(cluster_key, b"hmac-sha256")
            self._aead = AESGCM(_derive(cluster_key, b"aes-256-gcm"))
            self.kind = AEAD if encrypt else MAC

    @property
    def keyed(self) -> bool:
        return self._mac_key is not None

    def seal(self, bound: bytes, payload: memoryview) -> tuple[bytes, bytes | memoryview]:
        """(extra, body) for an object whose kind and header are `bound`: the MAC and the
        payload, or a fresh nonce and the ciphertext."""
        if self.kind == AEAD:
            assert self._aead is not None
            nonce = os.urandom(EXTRA_BYTES[AEAD])
            return nonce, self._aead.encrypt(nonce, payload, bound)
        if self.kind == MAC:
            return self._mac(bound, payload), payload
        return b"", payload

    def open(self, kind: int, bound: memoryview, extra: memoryview, body: memoryview) -> memoryview | bytes:
        """The payload of a `kind` object this seal accepts; SealError when it does not verify.
        (The caller has refused kinds this seal cannot check.)"""
        if kind == AEAD:
            if self._aead is None:
                raise SealError("no cluster key")
            try:
                return self._aead.decrypt(bytes(extra), body, bytes(bound))
            except InvalidTag:
                raise SealError("AES-GCM tag mismatch") from None
        if kind == MAC:
            if self._mac_key is None:
                raise SealError("no cluster key")
            if not hmac.compare_digest(self._mac(bound, body), extra):
                raise SealError("MAC mismatch")
            return body
        if self._mac_key is not None:
            raise SealError("unauthenticated object (written without the cluster key)")
        return body

    def _mac(self, bound: bytes | memoryview, body: bytes | memoryview) -> bytes:
        assert self._mac_key is not None
        mac = hmac.new(self._mac_key, bound, hashlib.sha256)
        mac.update(body)
        return mac.digest()
