"""Short-lived HMAC signatures a key holder puts on what it tells another peer over HTTP.

Used for the prefill/decode handoff header (the router signs where the KV waits; the decode
engine acts on it only with a valid signature) and for peer-only HTTP routes (the router's
/v1/engine_info polls and /v1/pd/prefill calls). A token is `EXPIRY.HEXMAC`, EXPIRY in unix
seconds; the MAC covers a purpose string, the fields and the expiry, so a token for one purpose,
transfer or path is worth nothing for another. Peers' clocks must agree within TOKEN_TTL_S.
"""

from __future__ import annotations

import hashlib
import hmac
import time

PEER_HEADER = "x-deepinfer-peer"  # a peer's token on peer-only HTTP routes
TOKEN_TTL_S = 120.0


def sign(key: bytes, purpose: str, *fields: str, ttl_s: float = TOKEN_TTL_S) -> str:
    expiry = int(time.time() + ttl_s)
    return f"{expiry}.{_mac(key, purpose, fields, expiry)}"


def verify(key: bytes, token: str, purpose: str, *fields: str) -> bool:
    """True when `token` is this key's unexpired signature of exactly these fields."""
    expiry_text, _, mac = token.partition(".")
    if not expiry_text.isdigit() or len(expiry_text) > 12:
        return False
    expiry = int(expiry_text)
    if expiry < time.time():
        return False
    return hmac.compare_digest(mac, _mac(key, purpose, fields, expiry))


def _mac(key: bytes, purpose: str, fields: tuple[str, ...], expiry: int) -> str:
    # Lengths first: ("ab", "c") and ("a", "bc") sign differently.
    message = "\0".join([purpose, str(expiry), *(f"{len(f)}:{f}" for f in fields)])
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def peer_token(key: bytes, method: str, path: str) -> str:
    """The PEER_HEADER value for one route."""
    return sign(key, "peer-http", method.upper(), path)


def is_peer(key: bytes | None, token: str | None, method: str, path: str) -> bool:
    return key is not None and token is not None and verify(key, token, "peer-http", method.upper(), path)


HANDOFF_PURPOSE = "kv-handoff"


def handoff_fields(transfer_id: str | None, address: str | None, error: str | None) -> tuple[str, ...]:
    """What a handoff signature covers (None and "" differ: a marker before each)."""
    return tuple("-" if v is None else "+" + v for v in (transfer_id, address, error))


def sign_handoff(key: bytes, transfer_id: str | None, address: str | None, error: str | None) -> str:
    """The router's signature on an x-deepinfer-kv-transfer header's fields."""
    return sign(key, HANDOFF_PURPOSE, *handoff_fields(transfer_id, address, error))
