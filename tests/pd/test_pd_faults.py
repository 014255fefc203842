"""Faults of a disaggregated deployment, with real processes on loopback: a decoder that never
pulls its KV, one that stalls mid-transfer, a decode engine killed mid-stream, the prefill engine
killed. Streams end with an error event (never a hang), later requests succeed elsewhere or are
recomputed (kv_transfer_failure=recompute) or fail cleanly (=fail), and after each fault no
engine holds a KV block once its requests end.

The tests run in order on one cluster: 1 prefill engine (a 3-second lease) and 2 decode engines
behind the router, plus a decode engine with kv_transfer_failure=fail that a client addresses
directly (the router would route around what this test wants to see).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import msgspec
import pytest

from deepinfer.engine.kv_cache.prefix import extend_block_hashes, namespace_root
from deepinfer.security.peer_auth import dial_peer
from deepinfer.sequence import KVSource
from deepinfer.transport.kv_transfer import (
    KVPuller,
    PullReply,
    PullRequest,
    TransferError,
    recv_frame,
    send_frame,
)
from tests.pd.apis import ask
from tests.pd.cluster import (
    MODEL,
    RouterProcess,
    blocks_in_use,
    cluster_key,
    elapsed,
    engine_info,
    peer_headers,
    replica,
    signed_handoff,
    start_all,
    stop_all,
    wait_all_blocks_free,
)
from tests.server.server_process import pid_alive, wait_until

pytestmark = pytest.mark.slow

LEASE_S = 3.0
DOCUMENT = " ".join(f"Rule {i}: every visitor signs the book at the gate before noon." for i in range(45))
KV_HEADER = "x-deepinfer-kv-transfer"


@pytest.fixture(scope="module")
def cluster():
    servers = {
        "prefill": replica("--role", "prefill", "--kv-transfer-lease", str(LEASE_S)),
        "decode1": replica("--role", "decode"),
        "decode2": replica("--role", "decode"),
        "strict": replica("--role", "decode", "--kv-transfer-failure", "fail", "--kv-transfer-timeout", "5"),
    }
    start_all(list(servers.values()))
    router = None
    try:
        router = RouterProcess(
            "--prefill",
            servers["prefill"].url,
            "--decode",
            servers["decode1"].url,
            "--decode",
            servers["decode2"].url,
            "--unhealthy-after",
            "1",
        ).start()
        router.wait_ready()
        state = {**servers, "router": router}
        # The answer every later request must reproduce, computed while nothing is broken.
        state["expected"] = ask(router.url, "completions", DOCUMENT, False)[0]
        yield state
    finally:
        if router is not None:
            router.kill()
        stop_all(list(servers.values()))


def tokens_of(cluster, text: str) -> list[int]:
    reply = httpx.post(cluster["decode1"].url + "/tokenize", json={"prompt": text}, timeout=60)
    return reply.json()["tokens"]


def prefill_directly(cluster, transfer_id: str, token_ids: list[int]) -> dict:
    """What the router does first: prefill on the prefill engine, under a transfer id."""
    reply = httpx.post(
        cluster["prefill"].url + "/v1/pd/prefill",
        json={"transfer_id": transfer_id, "prompt_token_ids": token_ids},
        headers=peer_headers("POST", "/v1/pd/prefill"),
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_decoder_that_never_comes_does_not_hold_the_kv(cluster) -> None:
    handoff = prefill_directly(cluster, "never-pulled", tokens_of(cluster, DOCUMENT))
    assert handoff["num_blocks"] > 0 and handoff["address"]
    assert blocks_in_use(cluster["prefill"]) == 0  # the leased chunks wait in host memory
    time.sleep(LEASE_S + 0.5)
    layout = engine_info(cluster["prefill"])["kv_transfer_layout"]
    source = KVSource(handoff["address"], "never-pulled")
    with pytest.raises(TransferError, match="unknown"):  # the lease ended
        KVPuller(5.0, key=cluster_key()).pull(source, [], layout).result()


def test_a_transfer_that_stalls_past_the_lease(cluster) -> None:
    token_ids = tokens_of(cluster, DOCUMENT)
    handoff = prefill_directly(cluster, "stalled", token_ids)
    info = engine_info(cluster["prefill"])
    hashes: list[bytes] = []
    usable = (len(token_ids) - 1) // info["block_size"] * info["block_size"]
    extend_block_hashes(hashes, namespace_root(info["fingerprint"]), token_ids[:usable], info["block_size"])
    # The chunk keys: whole chunks of --kv-chunk-blocks' default 16 blocks, then the tail's piece.
    keys = hashes[15::16] + ([hashes[-1]] if len(hashes) % 16 else [])
    host, port = handoff["address"].rsplit(":", 1)
    # A decoder that asks for the KV (megabytes: more than the socket buffers) and stops reading.
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        dial_peer(stalled, cluster_key())
        send_frame(stalled, PullRequest("stalled", keys, info["kv_transfer_layout"]))
        time.sleep(LEASE_S + 1)
        # The prefiller gave up the send when the lease ended and reset the connection (dropping
        # what it still held for this reader): the transfer ends short, and soon.
        reply = msgspec.msgpack.decode(recv_frame(stalled, 1 << 20, time.monotonic() + 10), type=PullReply)
        expected, received = sum(reply.sizes), 0
        stalled.settimeout(10)
        try:
            while data := stalled.recv(1 << 20):
                received += len(data)
        except ConnectionResetError:
            pass
        assert 0 < received < expected
    finally:
        stalled.close()
    # A decoder that comes for it now finds no lease and recomputes: same answer, no leak.
    source = signed_handoff(address=handoff["address"], transfer_id="stalled")
    reply = httpx.post(
        cluster["decode1"].url + "/v1/completions",
        json={"model": MODEL, "prompt": DOCUMENT, "max_tokens": 8, "temperature": 0},
        headers={KV_HEADER: source},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == cluster["expected"]
    wait_all_blocks_free([cluster["prefill"], cluster["decode1"]])


def test_a_decode_engine_killed_mid_stream(cluster) -> None:
    router = cluster["router"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=httpx.Timeout(60.0)) as client,
        client.stream("POST", router.url + "/v1/chat/completions", json=body) as stream,
    ):
        serving = stream.headers["x-deepinfer-replica"]
        victim = next(cluster[n] for n in ("decode1", "decode2") if cluster[n].url == serving)
        survivor = next(cluster[n] for n in ("decode1", "decode2") if cluster[n].url != serving)
        lines = stream.iter_lines()
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        victim.kill()
        killed_at = time.monotonic()
        rest = list(lines)  # must end, not hang (the read timeout would fail the test)
    assert elapsed(killed_at) < 15
    errors = [
        json.loads(line[len("data: ") :]) for line in rest if line.startswith("data: {") and '"error"' in line
    ]
    assert errors and errors[-1]["error"]["type"] and "mid-stream" in errors[-1]["error"]["message"]
    assert not any(serving.split("//")[1] in line for line in rest)  # nor where it ran
    assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
    assert wait_until(lambda: not pid_alive(victim.engine_pid), 10)
    # New requests go to the other decoder (the first may be retried there: before any byte).
    for _ in range(3):
        answer, _, _ = ask(router.url, "completions", DOCUMENT, False)
        assert answer == cluster["expected"]
    assert wait_until(
        lambda: not next(r for r in router.health()["replicas"] if r["url"] == serving)["healthy"], 10
    )
    wait_all_blocks_free([cluster["prefill"], survivor])
    cluster["survivor"] = survivor


def test_the_prefill_engine_killed(cluster) -> None:
    router, prefill, strict = cluster["router"], cluster["prefill"], cluster["strict"]
    address = engine_info(prefill)["kv_transfer_address"]
    prefill.kill()
    assert wait_until(lambda: not pid_alive(prefill.engine_pid), 10)
    # kv_transfer_failure=recompute (the router's decoder): the prompt is computed there.
    answer, _, _ = ask(router.url, "completions", DOCUMENT, False)
    assert answer == cluster["expected"]
    # kv_transfer_failure=fail: a prefill the router reports as failed is a clean error...
    body = {"model": MODEL, "prompt": DOCUMENT, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(
        strict.url + "/v1/completions",
        json=body,
        headers={KV_HEADER: signed_handoff(error="prefill gone")},
        timeout=60,
    )
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "kv_transfer_failed"
    # ...and so is a pull from the dead prefill engine, plain or streamed.
    source = {KV_HEADER: signed_handoff(address=address, transfer_id="lost")}
    reply = httpx.post(strict.url + "/v1/completions", json=body, headers=source, timeout=60)
    assert reply.status_code == 500 and "did not arrive" in reply.json()["error"]["message"]
    assert address not in reply.text  # the transfer listener's address is internal
    messages = {
        "model": MODEL,
        "messages": [{"role": "user", "content": DOCUMENT}],
        "max_tokens": 8,
        "stream": True,
    }
    source = {KV_HEADER: signed_handoff(address=address, transfer_id="lost")}  # each is good once
    with httpx.stream(
        "POST", strict.url + "/v1/messages", json=messages, headers=source, timeout=60
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "event: error"
    wait_all_blocks_free([cluster["survivor"], strict])
