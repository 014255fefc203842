"""Findings 1 and 3 of issue 30, on a real decode engine publishing KV events, two tenants:

1. `/v1/engine_info` named the KV events endpoint to anyone, and a plain SUB socket read every
   tenant's prompt tokens there. Now engine_info is for peers (a cluster-key token) and the
   events socket is CURVE-keyed from the cluster key: a stranger's SUB reads nothing, while a
   key holder still gets vLLM's format, token ids included.
3. Any API key holder's `x-deepinfer-kv-transfer` made the decode engine connect where it said
   (SSRF) and install what came back in the shared prefix cache. Now the header is acted on only
   with the router's signature, and even then a KV server without the key is refused.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from deepinfer.security.curve import client_keys, server_keys
from deepinfer.security.peer_auth import MAGIC
from deepinfer.security.signing import sign_handoff
from deepinfer.transport.kv_events import BlockStored, decode_batch
from tests.pd.cluster import MODEL, cluster_key, peer_headers, replica, signed_handoff
from tests.security.conftest import TENANT_A, TENANT_B, as_key, error_of

pytestmark = pytest.mark.slow

KV_HEADER = "x-deepinfer-kv-transfer"
SECRET = "078-05-1120"
PROMPT = (
    f"My social security number is {SECRET}; keep it safe. "
    + "Here are my notes on the trip, line after line. " * 6
    + "What is the capital of France?"
)


@pytest.fixture(scope="module")
def decode():
    process = replica("--role", "decode", "--api-key", TENANT_A, "--api-key", TENANT_B).start()
    yield process
    process.kill()


def chat(server, key: str, headers: dict[str, str] | None = None, prompt: str = PROMPT) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={**as_key(key), **(headers or {})},
        timeout=300,
    )


def events_endpoint(server) -> str:
    reply = httpx.get(
        server.url + "/v1/engine_info", headers=peer_headers("GET", "/v1/engine_info"), timeout=30
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_events_endpoint"]


def test_engine_info_is_for_peers_only(decode) -> None:
    url = decode.url + "/v1/engine_info"
    assert error_of(httpx.get(url, timeout=30), 401)["code"] == "peer_auth_failed"
    assert error_of(httpx.get(url, headers=as_key(TENANT_B), timeout=30), 401)["code"] == "peer_auth_failed"
    # A token for another route (or signed with another key) is no pass here.
    other_route = peer_headers("POST", "/v1/pd/prefill")
    assert error_of(httpx.get(url, headers=other_route, timeout=30), 401)["code"] == "peer_auth_failed"
    assert events_endpoint(decode).startswith("tcp://127.0.0.1:")


def test_a_strangers_subscriber_reads_no_tenants_tokens(decode) -> None:
    endpoint = events_endpoint(decode)
    context = zmq.Context()
    stranger = context.socket(zmq.SUB)
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.connect(endpoint)
    peer = context.socket(zmq.SUB)
    peer.setsockopt(zmq.SUBSCRIBE, b"")
    peer.curve_publickey, peer.curve_secretkey = client_keys(cluster_key())
    peer.curve_serverkey = server_keys(cluster_key())[0]
    peer.connect(endpoint)
    try:
        # Until the key holder hears the engine (PUB/SUB: the first batches may go before the
        # subscription lands), tenant A asks; the stranger connected as early and heard nothing.
        token_ids: list[int] = []
        deadline = time.monotonic() + 120
        while not token_ids and time.monotonic() < deadline:
            assert chat(decode, TENANT_A, prompt=f"{secrets.token_hex(4)} {PROMPT}").status_code == 200
            while peer.poll(2000):
                for event in decode_batch(peer.recv_multipart()[2]).events:
                    if isinstance(event, BlockStored):
                        token_ids += event.token_ids  # vLLM's format, tokens included, for peers
        assert token_ids
        text = httpx.post(
            decode.url + "/detokenize", json={"tokens": token_ids}, headers=as_key(TENANT_A), timeout=30
        ).json()["prompt"]
        assert SECRET in text
        assert stranger.poll(1000) == 0
    finally:
        stranger.close(0)
        peer.close(0)
        context.term()


class FakeKVServer:
    """A stranger's 'prefill engine': speaks the handshake's first line, cannot prove the key,
    and would serve noise. It counts the connections the decode engine makes to it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(10)
                conn.sendall(MAGIC + b"\x01" + secrets.token_bytes(32))
                conn.recv(64)
                conn.sendall(secrets.token_bytes(32))  # no valid proof: noise

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def fake():
    server = FakeKVServer()
    yield server
    server.close()


def test_a_tenants_handoff_header_is_refused_and_connects_nowhere(decode, fake) -> None:
    header = json.dumps({"address": fake.address, "transfer_id": "pd-poison"})
    error = error_of(chat(decode, TENANT_B, {KV_HEADER: header}), 403)
    assert error["param"] == KV_HEADER and error["code"] == "peer_auth_failed"
    forged = json.dumps(
        {
            "address": fake.address,
            "transfer_id": "pd-poison",
            "signature": sign_handoff(b"n" * 32, "pd-poison", fake.address, None),
        }
    )
    assert error_of(chat(decode, TENANT_B, {KV_HEADER: forged}), 403)["param"] == KV_HEADER
    # A signed header cannot be moved to another address either.
    moved = json.loads(signed_handoff(address="127.0.0.1:9", transfer_id="pd-poison"))
    moved["address"] = fake.address
    assert error_of(chat(decode, TENANT_B, {KV_HEADER: json.dumps(moved)}), 403)["param"] == KV_HEADER
    assert fake.connections == 0


def test_even_a_signed_handoff_installs_nothing_from_a_server_without_the_key(decode, fake) -> None:
    question = "What is the capital of France? Answer in one word."
    header = signed_handoff(address=fake.address, transfer_id="pd-signed")
    poisoned = chat(decode, TENANT_B, {KV_HEADER: header}, prompt=question)
    assert poisoned.status_code == 200, poisoned.text
    assert fake.connections == 1  # it tried, was refused by the handshake, and recomputed
    clean = chat(decode, TENANT_A, prompt=question)
    answer = msgspec.json.decode(poisoned.content)["choices"][0]["message"]["content"]
    assert answer == clean.json()["choices"][0]["message"]["content"]


def test_a_peer_token_or_handoff_is_good_once(decode) -> None:
    # The peers' HTTP is not encrypted: a token read off the wire must be worth nothing again.
    url = decode.url + "/v1/engine_info"
    token = peer_headers("GET", "/v1/engine_info")
    assert httpx.get(url, headers=token, timeout=30).status_code == 200
    replayed = error_of(httpx.get(url, headers=token, timeout=30), 403)
    assert replayed["code"] == "peer_auth_failed" and "used before" in replayed["message"]
    assert httpx.get(url, headers=peer_headers("GET", "/v1/engine_info"), timeout=30).status_code == 200
    # A prefill the router reports as failed: recomputed here (the default), once.
    handoff = {KV_HEADER: signed_handoff(error="the prefill replica answered 503")}
    assert chat(decode, TENANT_A, handoff).status_code == 200
    replayed = error_of(chat(decode, TENANT_B, handoff), 403)
    assert replayed["param"] == KV_HEADER and "used before" in replayed["message"]
    fresh = {KV_HEADER: signed_handoff(error="the prefill replica answered 503")}
    assert chat(decode, TENANT_B, fresh).status_code == 200
