"""ZeroMQ CURVE keys for the KV events socket, derived from the cluster key.

Every holder of the cluster key derives the same two key pairs: the publisher's (its socket is a
CURVE server) and the subscribers' (the one client key the publisher's ZAP handler accepts). So a
subscriber without the cluster key can neither complete the handshake nor read a byte, and what
the events carry (token ids: prompts) is encrypted on the wire. vLLM's message format is unchanged
inside; a vLLM-side consumer needs the same derived keys (docs/security.md says how).
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
import zmq.utils.z85


def _secret(key: bytes, who: bytes) -> bytes:
    raw = hmac.new(key, b"deepinfer kv-events curve " + who, hashlib.sha256).digest()
    return zmq.utils.z85.encode(raw)


def server_keys(key: bytes) -> tuple[bytes, bytes]:
    """(public, secret), z85, of the publisher."""
    secret = _secret(key, b"server")
    return zmq.curve_public(secret), secret


def client_keys(key: bytes) -> tuple[bytes, bytes]:
    """(public, secret), z85, of every authorized subscriber."""
    secret = _secret(key, b"client")
    return zmq.curve_public(secret), secret
