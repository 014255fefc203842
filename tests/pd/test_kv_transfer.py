"""The direct KV transfer on loopback: leases of chunks, pulls by chunk key, a decoder of another
chunk layout, and the failures that must never hold a lease past its end (a decoder that never
comes, one that stalls, a prefiller that is gone)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from deepinfer.security.peer_auth import dial_peer
from deepinfer.sequence import KVSource
from deepinfer.transport.kv_transfer import (
    KVPuller,
    KVTransferServer,
    PullRequest,
    TransferError,
    send_frame,
)

LAYOUT = "deepinfer-kv-chunk-v2|64|test"


def payloads(values: list[int]) -> list[np.ndarray]:
    """Chunks whose bytes are their value, of different sizes (a first chunk's sliding part is
    shorter than a later one's)."""
    return [np.full(8 + value, value, dtype=np.uint8) for value in values]


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


@pytest.fixture
def server():
    s = KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=2.0)
    yield s
    s.close()


def test_a_pull_gets_the_longest_run_it_asks_for_and_ends_the_lease(server) -> None:
    assert server.lease("t1", hashes(5), payloads([10, 11, 12, 13, 14]))
    assert server.num_bytes == sum(8 + v for v in range(10, 15))
    puller = KVPuller(timeout_s=5.0)
    chunks = puller.pull(KVSource(server.address, "t1"), [*hashes(5)[2:], b"\xff" * 32], LAYOUT).result()
    assert [(c.dtype, c.size, set(c.tolist())) for c in chunks] == [
        (np.uint8, 8 + v, {v}) for v in (12, 13, 14)
    ]
    # One pull per lease: the chunks are dropped, a second pull finds nothing.
    deadline = time.monotonic() + 5
    while not (reaped := server.reap()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [lease.transfer_id for lease in reaped] == ["t1"] and server.num_bytes == 0
    with pytest.raises(TransferError, match="unknown"):
        puller.pull(KVSource(server.address, "t1"), hashes(5), LAYOUT).result()
    puller.close()


def test_a_decoder_of_another_chunk_layout_is_refused_and_the_lease_ends(server) -> None:
    server.lease("t7", hashes(2), payloads([1, 2]))
    other = "deepinfer-kv-chunk-v2|32|test"  # another kv_chunk_blocks
    with pytest.raises(TransferError, match=r"mismatch: .*kv_chunk_blocks"):
        KVPuller(5.0).pull(KVSource(server.address, "t7"), hashes(2), other).result()
    deadline = time.monotonic() + 5
    while not (reaped := server.reap()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [lease.transfer_id for lease in reaped] == ["t7"] and server.num_failed == 1


def test_an_empty_pull_releases_the_lease(server) -> None:
    server.lease("t2", hashes(2), payloads([1, 2]))
    assert KVPuller(5.0).pull(KVSource(server.address, "t2"), [], LAYOUT).result() == []
    deadline = time.monotonic() + 5
    while server.num_leases and time.monotonic() < deadline:
        server.reap()
        time.sleep(0.01)
    assert server.num_leases == 0 and server.num_sent == 1


def test_a_decoder_that_never_comes_loses_the_lease(server) -> None:
    server.lease("t3", hashes(2), payloads([1, 2]))
    assert server.reap() == []
    time.sleep(2.1)
    assert [lease.transfer_id for lease in server.reap()] == ["t3"]
    assert server.num_expired == 1


def test_a_decoder_that_stalls_mid_transfer_loses_the_connection_when_the_lease_ends() -> None:
    many = 64  # chunks of 1 MiB: far more than the socket buffers hold
    server = KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=1.0)
    try:
        keys = [i.to_bytes(32, "big") for i in range(many)]
        server.lease("t4", keys, [np.zeros(1 << 20, dtype=np.uint8)] * many)
        host, port = server.address.rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)))
        dial_peer(stalled, None)
        send_frame(stalled, PullRequest("t4", keys, LAYOUT))
        # ...and never reads. The send is bounded by the lease: the lease ends.
        deadline = time.monotonic() + 10
        reaped = []
        while not reaped and time.monotonic() < deadline:
            reaped = server.reap()
            time.sleep(0.05)
        assert reaped and reaped[0].transfer_id == "t4"
        assert server.num_failed == 1
        stalled.close()
    finally:
        server.close()


def test_a_prefiller_that_is_gone_fails_the_pull_at_once() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    started = time.monotonic()
    with pytest.raises(TransferError, match="unreachable"):
        KVPuller(30.0).pull(KVSource(f"127.0.0.1:{port}", "t5"), hashes(1), LAYOUT).result()
    assert time.monotonic() - started < 5


def test_a_pull_that_takes_too_long_times_out() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TimeoutError, match="longer than"):
            KVPuller(0.5).pull(KVSource(address, "t6"), hashes(1), LAYOUT).result()
    finally:
        silent.close()
