"""Mutual HMAC challenge-response at the start of a peer TCP connection (KV and embedding transfer).

Why not TLS with a pre-shared key: Python's ssl module has PSK callbacks only from 3.13 (we run
on 3.11), a certificate authority per deployment is more to operate than one secret file, and the
transfer moves gigabytes of KV with zero-copy `sendall`/`recv_into`, which TLS would turn into
encrypted copies. What this gives: both ends prove they hold the cluster key before either reads
anything of variable size; the listener's first bytes are fixed-size, so a stranger costs it 90
bytes and one deadline, never an allocation of the size the stranger announces. What it does not
give: confidentiality or integrity of the bytes that follow against someone on the network path
(see docs/security.md: run peers on a private network or a VPN such as WireGuard).

Listener -> dialer: MAGIC, mode (0: no key, 1: HMAC-SHA256), 32-byte nonce.
Dialer -> listener (mode 1): its 32-byte nonce, HMAC(key, "dialer" | both nonces).
Listener -> dialer (mode 1): HMAC(key, "listener" | both nonces).
Keyless listeners (loopback only) send mode 0 and expect nothing back; a keyed end meeting a
keyless one, or the reverse, fails with an error naming --cluster-key-file.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time

from deepinfer.security.cluster_key import CLUSTER_KEY_FLAG

MAGIC = b"DIPEER1"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0  # a stranger holds a listener's connection slot at most this long
_NO_KEY, _HMAC = 0, 1


class PeerAuthError(ConnectionError):
    """The other end does not hold our cluster key (or speaks another protocol)."""


def _mac(key: bytes, role: bytes, listener_nonce: bytes, dialer_nonce: bytes) -> bytes:
    return hmac.new(key, role + b"\0" + listener_nonce + dialer_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    received = 0
    while received < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the peer handshake timed out")
        sock.settimeout(remaining)
        n = sock.recv_into(view[received:])
        if n == 0:
            raise PeerAuthError("the peer closed the connection during the handshake")
        received += n
    return bytes(data)


def accept_peer(sock: socket.socket, key: bytes | None, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The listener's side; returns once the dialer proved it holds `key` (None: keyless)."""
    deadline = time.monotonic() + timeout_s
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(timeout_s)
    sock.sendall(MAGIC + bytes([_NO_KEY if key is None else _HMAC]) + nonce)
    if key is None:
        return
    answer = _recv_exact(sock, NONCE_BYTES + MAC_BYTES, deadline)
    dialer_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"dialer", nonce, dialer_nonce)):
        raise PeerAuthError("the peer does not hold this cluster key")
    sock.sendall(_mac(key, b"listener", nonce, dialer_nonce))


def dial_peer(sock: socket.socket, key: bytes | None, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The dialer's side; returns once the listener proved it holds `key` too."""
    deadline = time.monotonic() + timeout_s
    hello = _recv_exact(sock, len(MAGIC) + 1 + NONCE_BYTES, deadline)
    if not hello.startswith(MAGIC):
        raise PeerAuthError("the peer does not speak DeepInfer's transfer protocol")
    mode, nonce = hello[len(MAGIC)], hello[len(MAGIC) + 1 :]
    if mode == _NO_KEY:
        if key is not None:
            raise PeerAuthError(f"the peer has no {CLUSTER_KEY_FLAG}: it cannot prove who it is")
        return
    if mode != _HMAC:
        raise PeerAuthError(f"the peer asks for an unknown authentication ({mode})")
    if key is None:
        raise PeerAuthError(f"the peer requires a {CLUSTER_KEY_FLAG}, and this process has none")
    dialer_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(dialer_nonce + _mac(key, b"dialer", nonce, dialer_nonce))
    try:
        proof = _recv_exact(sock, MAC_BYTES, deadline)
    except (PeerAuthError, ConnectionResetError):  # the listener cut us: it checked our proof
        raise PeerAuthError("the peer refused our proof: it does not hold this cluster key") from None
    if not hmac.compare_digest(proof, _mac(key, b"listener", nonce, dialer_nonce)):
        raise PeerAuthError("the peer does not hold this cluster key")
