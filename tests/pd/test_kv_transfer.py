"""The direct KV transfer on loopback: leases, pulls by prefix hash, and the failures that must
never pin a block (a decoder that never comes, one that stalls, a prefiller that is gone)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from deepinfer.engine.kv_transfer import (
    KVPuller,
    KVTransferServer,
    PullRequest,
    TransferError,
    send_frame,
)
from deepinfer.sequence import KVSource

TOKENS_PER_BLOCK = 4


class FakeCaches:
    """Blocks whose KV is their id: [2 tensors, tokens, 3] (reads only, like a prefiller's)."""

    def read_blocks(self, group: int, block_ids: list[int]) -> np.ndarray:
        rows = np.repeat(np.array(block_ids, dtype=np.float32), TOKENS_PER_BLOCK)
        return np.broadcast_to(rows[None, :, None], (2, len(rows), 3)).copy()


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


@pytest.fixture
def server():
    s = KVTransferServer(FakeCaches(), "127.0.0.1", 0, lease_s=2.0)
    yield s
    s.close()


def test_a_pull_gets_the_longest_run_it_asks_for_and_ends_the_lease(server) -> None:
    assert server.lease("t1", hashes(5), [10, 11, 12, 13, 14])
    puller = KVPuller(timeout_s=5.0)
    kv = puller.pull(KVSource(server.address, "t1"), [*hashes(5)[2:], b"\xff" * 32]).result()
    assert kv.shape == (2, 3 * TOKENS_PER_BLOCK, 3)
    assert kv[0, :, 0].tolist() == [12.0] * 4 + [13.0] * 4 + [14.0] * 4
    # One pull per lease: the blocks are given back, a second pull finds nothing.
    deadline = time.monotonic() + 5
    while not (reaped := server.reap()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [lease.block_ids for lease in reaped] == [[10, 11, 12, 13, 14]]
    with pytest.raises(TransferError, match="unknown"):
        puller.pull(KVSource(server.address, "t1"), hashes(5)).result()
    puller.close()


def test_an_empty_pull_releases_the_lease(server) -> None:
    server.lease("t2", hashes(2), [1, 2])
    assert KVPuller(5.0).pull(KVSource(server.address, "t2"), []).result() is None
    deadline = time.monotonic() + 5
    while server.num_leases and time.monotonic() < deadline:
        server.reap()
        time.sleep(0.01)
    assert server.num_leases == 0 and server.num_sent == 1


def test_a_decoder_that_never_comes_loses_the_lease(server) -> None:
    server.lease("t3", hashes(2), [1, 2])
    assert server.reap() == []
    time.sleep(2.1)
    assert [lease.transfer_id for lease in server.reap()] == ["t3"]
    assert server.num_expired == 1


def test_a_decoder_that_stalls_mid_transfer_loses_the_connection_when_the_lease_ends() -> None:
    big = 1 << 16  # blocks: 2 * 64Ki * 4 * 3 * 4 bytes, far more than the socket buffers hold
    server = KVTransferServer(FakeCaches(), "127.0.0.1", 0, lease_s=1.0)
    try:
        many = [i.to_bytes(32, "big") for i in range(big)]
        server.lease("t4", many, list(range(big)))
        host, port = server.address.rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)))
        send_frame(stalled, PullRequest("t4", many))
        # ...and never reads. The send is bounded by the lease: the blocks come back.
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
        KVPuller(30.0).pull(KVSource(f"127.0.0.1:{port}", "t5"), hashes(1)).result()
    assert time.monotonic() - started < 5


def test_a_pull_that_takes_too_long_times_out() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TimeoutError, match="longer than"):
            KVPuller(0.5).pull(KVSource(address, "t6"), hashes(1)).result()
    finally:
        silent.close()
