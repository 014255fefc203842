"""Short-lived, single-use HMAC signatures a key holder puts on what it tells another peer over HTTP.

Used for the prefill/decode handoff header (the router signs where the KV waits; the decode
engine acts on it only with a valid signature) and for peer-only HTTP routes (the router's
/v1/engine_info polls and /v1/pd/prefill calls). A token is `EXPIRY.NONCE.HEXMAC`, EXPIRY in unix
seconds, NONCE random; the MAC covers a purpose string, the fields, the expiry and the nonce, so
a token for one purpose, transfer or path is worth nothing for another. Peers' clocks must agree
within TOKEN_TTL_S.

A token is good once: the process that accepts it remembers its nonce until it expires
(`SpentTokens`), so one read off the wire (the peers' HTTP is plain) cannot be replayed. Only
tokens with a valid MAC are remembered, so only a key holder can fill that memory, and it is
bounded: past MAX_SPENT live tokens, new ones are refused until old ones expire.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import hmac
import secrets
import threading
import time

PEER_HEADER = "x-deepinfer-peer"  # a peer's token on peer-only HTTP routes
TOKEN_TTL_S = 120.0
# Live tokens one process remembers: 131,072 in two minutes is over 1,000 a second, more handoffs
# and peer calls than an engine serves; at about 200 bytes each, 26 MB at most.
MAX_SPENT = 1 << 17


class TokenCheck(enum.Enum):
    VALID = "valid"  # signed with the key, unexpired, first use: now spent
    INVALID = "invalid"  # malformed, expired, or not this key's signature of these fields
    SPENT = "spent"  # a valid signature already accepted once (a replay), or no room to remember it


class SpentTokens:
    """Nonces of the tokens accepted so far, each until its token expires."""

    __slots__ = ("_capacity", "_expiries", "_lock", "_nonces")

    def __init__(self, capacity: int = MAX_SPENT) -> None:
        self._capacity = capacity
        self._nonces: set[str] = set()
        self._expiries: list[tuple[int, str]] = []  # a heap: the next to expire first
        self._lock = threading.Lock()  # uncontended on an event loop; callers may also be threads

    def spend(self, nonce: str, expiry: int) -> bool:
        """True the first time a nonce is spent before its expiry; False after (or when full)."""
        now = time.time()
        with self._lock:
            while self._expiries and self._expiries[0][0] < now:
                self._nonces.discard(heapq.heappop(self._expiries)[1])
            if nonce in self._nonces or len(self._nonces) >= self._capacity:
                return False
            self._nonces.add(nonce)
            heapq.heappush(self._expiries, (expiry, nonce))
            return True

    def __len__(self) -> int:
        return len(self._nonces)


SPENT = SpentTokens()  # this process's: every token it accepts, from any peer, for any purpose


def sign(key: bytes, purpose: str, *fields: str, ttl_s: float = TOKEN_TTL_S) -> str:
    expiry = int(time.time() + ttl_s)
    nonce = secrets.token_hex(16)
    return f"{expiry}.{nonce}.{_mac(key, purpose, fields, expiry, nonce)}"


def check(key: bytes, token: str, purpose: str, *fields: str, spent: SpentTokens = SPENT) -> TokenCheck:
    """Whether `token` is this key's unexpired signature of exactly these fields, not used before;
    a valid one is spent by this call."""
    parts = token.split(".", 2)
    if len(parts) != 3:
        return TokenCheck.INVALID
    expiry_text, nonce, mac = parts
    if not expiry_text.isdigit() or len(expiry_text) > 12 or len(nonce) != 32:
        return TokenCheck.INVALID
    expiry = int(expiry_text)
    if expiry < time.time():
        return TokenCheck.INVALID
    if not hmac.compare_digest(mac, _mac(key, purpose, fields, expiry, nonce)):
        return TokenCheck.INVALID
    return TokenCheck.VALID if spent.spend(nonce, expiry) else TokenCheck.SPENT


def _mac(key: bytes, purpose: str, fields: tuple[str, ...], expiry: int, nonce: str) -> str:
    # Lengths first: ("ab", "c") and ("a", "bc") sign differently.
    message = "\0".join([purpose, str(expiry), nonce, *(f"{len(f)}:{f}" for f in fields)])
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def peer_token(key: bytes, method: str, path: str) -> str:
    """The PEER_HEADER value for one route."""
    return sign(key, "peer-http", method.upper(), path)


def check_peer(key: bytes | None, token: str | None, method: str, path: str) -> TokenCheck:
    if key is None or token is None:
        return TokenCheck.INVALID
    return check(key, token, "peer-http", method.upper(), path)


HANDOFF_PURPOSE = "kv-handoff"


def handoff_fields(transfer_id: str | None, address: str | None, error: str | None) -> tuple[str, ...]:
    """What a handoff signature covers (None and "" differ: a marker before each)."""
    return tuple("-" if v is None else "+" + v for v in (transfer_id, address, error))


def sign_handoff(key: bytes, transfer_id: str | None, address: str | None, error: str | None) -> str:
    """The router's signature on an x-deepinfer-kv-transfer header's fields."""
    return sign(key, HANDOFF_PURPOSE, *handoff_fields(transfer_id, address, error))
