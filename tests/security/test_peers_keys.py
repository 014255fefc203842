"""The cluster secret itself: the key file's checks, loopback-only listeners without it, the
handoff signatures, and the KV events socket keyed from it (in process: no model needed)."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from deepinfer.cli import main
from deepinfer.config import ConfigError, DisaggregationConfig
from deepinfer.security import ClusterKeyError, read_cluster_key
from deepinfer.security.curve import client_keys, server_keys
from deepinfer.security.signing import (
    SpentTokens,
    TokenCheck,
    check,
    handoff_fields,
    sign,
    sign_handoff,
)
from deepinfer.server.errors import ApiError
from deepinfer.server.peers import check_handoff_signature
from deepinfer.transport.kv_event_log import DEVICE, Stored
from deepinfer.transport.kv_events import BlockStored, KVEventPublisher, decode_batch

KEY = b"k" * 32


def key_file(tmp_path, content: bytes, mode: int) -> str:
    path = tmp_path / "cluster.key"
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


def test_the_key_file_must_be_private_and_long_enough(tmp_path) -> None:
    assert read_cluster_key(key_file(tmp_path, b"s" * 40 + b"\n", 0o600)) == b"s" * 40
    for mode in (0o640, 0o604, 0o620):
        with pytest.raises(ClusterKeyError, match=r"--cluster-key-file .*chmod 600"):
            read_cluster_key(key_file(tmp_path, b"s" * 40, mode))
    with pytest.raises(ClusterKeyError, match=r"--cluster-key-file .*at least 32"):
        read_cluster_key(key_file(tmp_path, b"s" * 31, 0o600))
    with pytest.raises(ClusterKeyError, match="--cluster-key-file"):
        read_cluster_key(tmp_path / "missing")


def test_without_a_key_peer_listeners_bind_loopback_only() -> None:
    with pytest.raises(ConfigError, match="--cluster-key-file"):
        DisaggregationConfig(kv_transfer_host="0.0.0.0")
    with pytest.raises(ConfigError, match="--cluster-key-file"):
        DisaggregationConfig(kv_events_endpoint="tcp://*:5557")
    DisaggregationConfig(kv_transfer_host="::1", kv_events_endpoint="tcp://127.0.0.1:0")
    DisaggregationConfig(kv_transfer_host="0.0.0.0", cluster_key_file="/etc/deepinfer/cluster.key")


def test_a_handoff_signature_covers_every_field_and_expires() -> None:
    good = sign_handoff(KEY, "pd-1", "10.0.0.5:7000", None)
    check_handoff_signature(KEY, good, handoff_fields("pd-1", "10.0.0.5:7000", None))
    for fields in (("pd-2", "10.0.0.5:7000", None), ("pd-1", "10.0.0.6:7000", None), ("pd-1", None, None)):
        with pytest.raises(ApiError) as refused:
            check_handoff_signature(KEY, good, handoff_fields(*fields))
        assert refused.value.status == 403 and refused.value.param == "x-deepinfer-kv-transfer"
    with pytest.raises(ApiError):
        check_handoff_signature(b"o" * 32, good, handoff_fields("pd-1", "10.0.0.5:7000", None))
    with pytest.raises(ApiError, match="--cluster-key-file"):
        check_handoff_signature(None, good, handoff_fields("pd-1", "10.0.0.5:7000", None))
    assert check(KEY, sign(KEY, "p", "x", ttl_s=-1), "p", "x") is TokenCheck.INVALID
    assert check(KEY, "not-a-token", "p", "x") is TokenCheck.INVALID


def test_a_token_is_spent_once_and_forgotten_when_it_expires() -> None:
    spent = SpentTokens(capacity=3)
    tokens = [sign(KEY, "p", "x", ttl_s=1) for _ in range(3)]
    assert len(set(tokens)) == 3  # signed in the same second, still distinct (a nonce each)
    assert [check(KEY, t, "p", "x", spent=spent) for t in tokens] == [TokenCheck.VALID] * 3
    assert check(KEY, tokens[0], "p", "x", spent=spent) is TokenCheck.SPENT
    # Only valid tokens are remembered: a forged one neither passes nor takes room.
    assert check(KEY, sign(b"o" * 32, "p", "x"), "p", "x", spent=spent) is TokenCheck.INVALID
    assert len(spent) == 3
    # Full: a fourth live token is refused rather than letting memory grow (or old ones replay).
    assert check(KEY, sign(KEY, "p", "x"), "p", "x", spent=spent) is TokenCheck.SPENT
    time.sleep(2.1)  # the three expire: their nonces are dropped, and with them the room they took
    assert check(KEY, sign(KEY, "p", "x"), "p", "x", spent=spent) is TokenCheck.VALID
    assert len(spent) == 1
    assert check(KEY, tokens[1], "p", "x", spent=spent) is TokenCheck.INVALID  # expired, still no use


def _first_batch(publisher: KVEventPublisher, sub: zmq.Socket) -> object:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # PUB/SUB: the first sends may go before the subscription
        publisher.publish([Stored([b"\x01" * 32], None, [11, 12, 13, 14], 4, DEVICE)])
        if sub.poll(100):
            return decode_batch(sub.recv_multipart()[2])
    return None


@pytest.mark.parametrize("token_ids", [True, False])
def test_events_reach_key_holders_only_with_or_without_token_ids(token_ids: bool) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0", key=KEY, token_ids=token_ids)
    context = zmq.Context()
    stranger, peer = context.socket(zmq.SUB), context.socket(zmq.SUB)
    for sub in (stranger, peer):
        sub.setsockopt(zmq.SUBSCRIBE, b"")
    peer.curve_publickey, peer.curve_secretkey = client_keys(KEY)
    peer.curve_serverkey = server_keys(KEY)[0]
    stranger.connect(publisher.endpoint)
    peer.connect(publisher.endpoint)
    try:
        batch = _first_batch(publisher, peer)
        assert batch is not None
        (stored,) = batch.events
        assert isinstance(stored, BlockStored) and stored.block_hashes == [b"\x01" * 32]
        assert stored.token_ids == ([11, 12, 13, 14] if token_ids else [])
        assert stranger.poll(500) == 0
    finally:
        stranger.close(0)
        peer.close(0)
        context.term()
        publisher.close()


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--role", "decode"],
        ["serve", "--role", "prefill"],
        ["router", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"],
    ],
)
def test_disaggregation_refuses_to_start_without_a_key(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and "--cluster-key-file" in capsys.readouterr().err


def test_a_key_file_others_can_read_is_a_usage_error(tmp_path, capsys) -> None:
    path = key_file(tmp_path, b"s" * 40, 0o644)
    with pytest.raises(SystemExit) as exited:
        main(["router", "--replica", "http://127.0.0.1:9", "--cluster-key-file", path])
    assert exited.value.code == 2 and "--cluster-key-file" in capsys.readouterr().err
