"""Encrypted reasoning for stateless Responses clients (`include: ["reasoning.encrypted_content"]`).

A client that keeps no server-side state (`store: false`, Codex's default) still has to hand the
model its earlier reasoning: DeepSeek V4 keeps the reasoning of every turn of an agent loop in
the prompt. The server returns the reasoning as an opaque blob, AES-256-GCM under a server key,
and the client sends the blob back in the reasoning item of its next request, where it decrypts
into the reasoning text again. GCM authenticates: a blob that was altered, or sealed under
another key (another server, or this one before a restart with a generated key), is refused
with a 400 naming the item, never decrypted into something else.

Blob layout (URL-safe base64): version byte 1, a 12-byte random nonce, the ciphertext and tag.
The associated data binds the blob to its purpose, so no other ciphertext made with the key
passes for reasoning.
"""

from __future__ import annotations

import base64
import binascii
import os

from deepinfer.recipe.errors import RecipeError

_VERSION = b"\x01"
_NONCE_BYTES = 12
_KEY_BYTES = 32
_PURPOSE = b"deepinfer/responses/reasoning/v1"

ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"


class ReasoningSealer:
    """Seals reasoning text into a blob and opens blobs back into text, under one key."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # lazy: only servers need it

        if len(key) != _KEY_BYTES:
            raise ValueError(f"the reasoning key must be {_KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)

    @classmethod
    def generate(cls) -> ReasoningSealer:
        return cls(os.urandom(_KEY_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> ReasoningSealer:
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"the reasoning key must be {2 * _KEY_BYTES} hex digits") from None
        return cls(key)

    def seal(self, reasoning: str) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, reasoning.encode("utf-8"), _PURPOSE)
        return base64.urlsafe_b64encode(_VERSION + nonce + sealed).decode("ascii")

    def open(self, blob: str, param: str) -> str:
        """The reasoning text in `blob`; RecipeError (naming `param`) for anything else."""
        from cryptography.exceptions import InvalidTag

        refused = RecipeError(
            f"{param}: the encrypted reasoning cannot be decrypted by this server (altered, or made "
            "by another server or before a restart); drop the reasoning item or its encrypted_content",
            param=param,
        )
        try:
            raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise refused from None
        if len(raw) < 1 + _NONCE_BYTES + 16 or raw[:1] != _VERSION:
            raise refused
        nonce, sealed = raw[1 : 1 + _NONCE_BYTES], raw[1 + _NONCE_BYTES :]
        try:
            return self._aead.decrypt(nonce, sealed, _PURPOSE).decode("utf-8")
        except (InvalidTag, UnicodeDecodeError):
            raise refused from None
