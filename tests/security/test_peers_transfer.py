"""Finding 2 of issue 30: the KV transfer listener allocated whatever a stranger announced (40
connections announcing 64 MiB frames took a prefill engine from 913 to 3,474 MiB). Now a peer
proves it holds the cluster key before the listener reads anything of variable size, frames are
bounded before allocation, connections are capped and each has a deadline."""

from __future__ import annotations

import socket
import time
import tracemalloc

import httpx
import numpy as np
import pytest

from deepinfer.security.peer_auth import MAGIC, PeerAuthError, dial_peer
from deepinfer.sequence import KVSource
from deepinfer.transport.kv_transfer import (
    KVPuller,
    KVTransferServer,
    TransferError,
    recv_frame,
    split_address,
)
from tests.pd.cluster import cluster_key, engine_info, replica
from tests.security.conftest import TENANT_B, as_key, error_of

LAYOUT = "deepinfer-kv-chunk-v2|64|test"
HOSTILE_CONNECTIONS = 40
ANNOUNCED = 64 << 20


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def read_to_end(sock: socket.socket, deadline: float) -> bytes:
    """What the other end sends until it closes (or resets) the connection."""
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the listener kept the connection open (read {len(data)} bytes)")


def closed_unread(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=10) as sock:
            return read_to_end(sock, time.monotonic() + 10) == b""
    except ConnectionResetError:  # the reset may reach us while connect() returns
        return True


@pytest.fixture(scope="module")
def prefill():
    process = replica("--role", "prefill", "--api-key", TENANT_B).start()
    yield process
    process.kill()


@pytest.mark.slow
def test_hostile_connections_announcing_huge_frames_cost_the_engine_nothing(prefill) -> None:
    address = split_address(engine_info(prefill)["kv_transfer_address"])
    before = rss_mib(prefill.engine_pid)
    hostile = []
    for _ in range(HOSTILE_CONNECTIONS):
        sock = socket.create_connection(address, timeout=10)
        sock.sendall(ANNOUNCED.to_bytes(4, "big") + b"\x00" * 1024)  # a 64 MiB frame, 1 KiB of it
        hostile.append(sock)
    deadline = time.monotonic() + 30
    # Each is answered with the listener's challenge and then cut: 1 KiB is no valid proof.
    for sock in hostile:
        assert read_to_end(sock, deadline).startswith(MAGIC)
        sock.close()
    grown = rss_mib(prefill.engine_pid) - before
    assert grown < 100, f"the engine grew {grown:.0f} MiB"
    # Still serving peers: a key holder completes the handshake, a stranger is told why not.
    with socket.create_connection(address, timeout=10) as peer:
        dial_peer(peer, cluster_key())
    with (
        socket.create_connection(address, timeout=10) as stranger,
        pytest.raises(PeerAuthError, match="--cluster-key-file"),
    ):
        dial_peer(stranger, None)


@pytest.mark.slow
def test_a_tenant_cannot_run_the_routers_prefill(prefill) -> None:
    body = {"transfer_id": "tenant-chosen", "prompt_token_ids": [1, 2, 3]}
    reply = httpx.post(prefill.url + "/v1/pd/prefill", json=body, headers=as_key(TENANT_B), timeout=30)
    assert error_of(reply, 401)["code"] == "peer_auth_failed"


def test_a_puller_without_the_key_gets_no_kv() -> None:
    server = KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=5.0, key=b"k" * 32)
    try:
        server.lease("t1", [b"\x01" * 32], [np.full(16, 7, dtype=np.uint8)])
        source = KVSource(server.address, "t1")
        with pytest.raises(TransferError, match="--cluster-key-file"):
            KVPuller(5.0).pull(source, [b"\x01" * 32], LAYOUT).result()
        with pytest.raises(TransferError, match="does not hold this cluster key"):
            KVPuller(5.0, key=b"x" * 32).pull(source, [b"\x01" * 32], LAYOUT).result()
        chunks = KVPuller(5.0, key=b"k" * 32).pull(source, [b"\x01" * 32], LAYOUT).result()
        assert [c.tolist() for c in chunks] == [[7] * 16]
        assert server.num_refused == 2  # both strangers, and nothing else
    finally:
        server.close()


def test_a_keyed_puller_refuses_a_prefiller_without_the_key() -> None:
    """The decode side of finding 3: a fake KV server cannot feed a decode engine."""
    server = KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=5.0, key=b"x" * 32)
    try:
        server.lease("t1", [b"\x01" * 32], [np.full(16, 7, dtype=np.uint8)])
        with pytest.raises(TransferError, match="does not hold this cluster key"):
            KVPuller(5.0, key=b"k" * 32).pull(KVSource(server.address, "t1"), [b"\x01" * 32], LAYOUT).result()
    finally:
        server.close()


def test_connections_past_the_limit_are_closed_unread_and_silent_ones_time_out() -> None:
    server = KVTransferServer(
        LAYOUT, "127.0.0.1", 0, lease_s=5.0, key=b"k" * 32, max_connections=2, handshake_timeout_s=0.5
    )
    try:
        address = split_address(server.address)
        held = [socket.create_connection(address, timeout=10) for _ in range(2)]
        for sock in held:  # both are served: each got the challenge
            sock.settimeout(10)
            assert sock.recv(len(MAGIC)) == MAGIC
        assert closed_unread(address)  # the third: closed (reset) before a byte
        # The two silent ones lose their slots at the handshake deadline; then a peer gets in.
        for sock in held:
            read_to_end(sock, time.monotonic() + 10)
            sock.close()
        with socket.create_connection(address, timeout=10) as peer:
            dial_peer(peer, b"k" * 32)
        assert server.num_refused == 3
    finally:
        server.close()


def test_a_frame_larger_than_expected_fails_before_any_allocation() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(ANNOUNCED.to_bytes(4, "big") + b"\x00" * 1024)
        tracemalloc.start()
        try:
            with pytest.raises(TransferError, match="larger than"):
                recv_frame(right, 64 << 10, time.monotonic() + 5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20
