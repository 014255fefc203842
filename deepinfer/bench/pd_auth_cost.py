"""What authentication costs the peers' paths, keyless against keyed, alternating in one run.

- A direct KV pull (security/peer_auth.py's HMAC handshake): the same leases pulled over
  loopback with and without the key, median of many pulls.
- A peer token or handoff signature (security/signing.py): signing one and checking it (HMAC,
  and the single-use memory), per token.
- The KV events: the time a subscriber takes to receive a burst of batches, plain and CURVE,
  alternating `--event-rounds` times.
- With `--router N`: a router in front of one replica, keyless (no API key, no cluster key,
  plain events) against keyed (API and admin keys, `--cluster-key-file`: peer-token health
  checks, CURVE events feeding the router's index, per-key cache salts): N chat requests
  (a ~200-token prompt of their own, 8 tokens out) sent to each in turn, latency median and p90.

    .venv/bin/python -m deepinfer.bench.pd_auth_cost [--pulls 200] [--chunks 8] [--chunk-kib 768]
        [--batches 2000] [--event-rounds 5] [--router 30]

The default KV pull is 8 chunks of 768 KiB (6 MiB: SmolLM2-135M's fp32 KV of 16-block chunks is
about 2.2 MiB a chunk; the size matters less than the count of pulls, one handshake each).
Prefill/decode itself cannot run keyless (it needs signed handoffs): its auth costs are the pull
handshake and two tokens per request, measured here one by one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import zmq

from deepinfer.bench.cluster import Child, cluster_key_file, router, running
from deepinfer.bench.cluster import replica as keyed_replica
from deepinfer.distributed.topology import free_port
from deepinfer.security.curve import client_keys, server_keys
from deepinfer.security.signing import SpentTokens, check, sign
from deepinfer.sequence import KVSource
from deepinfer.transport.kv_event_log import DEVICE, Stored
from deepinfer.transport.kv_events import KVEventPublisher
from deepinfer.transport.kv_transfer import KVPuller, KVTransferServer

LAYOUT = "bench-layout"


def median_pulls_ms(pulls: int, chunks: int, chunk_bytes: int) -> tuple[float, float]:
    """Median ms of a pull without and with a key, pulls alternating so both see the same load."""
    sides = [
        (KVTransferServer(LAYOUT, "127.0.0.1", 0, lease_s=60.0, key=key), KVPuller(30.0, key=key))
        for key in (None, b"k" * 32)
    ]
    keys = [i.to_bytes(32, "big") for i in range(chunks)]
    payload = np.random.default_rng(0).integers(0, 255, chunk_bytes, dtype=np.uint8)
    times: list[list[float]] = [[], []]
    try:
        for i in range(pulls):
            for side, (server, puller) in enumerate(sides):
                server.lease(f"t{i}", keys, [payload] * chunks)
                started = time.perf_counter()
                puller.pull(KVSource(server.address, f"t{i}"), keys, LAYOUT).result()
                times[side].append(time.perf_counter() - started)
                server.reap()
    finally:
        for server, puller in sides:
            puller.close()
            server.close()
    plain, keyed = (statistics.median(t) * 1000 for t in times)
    return plain, keyed


def events_ms(key: bytes | None, batches: int) -> float:
    """Ms from the first publish of `batches` batches (16 stored blocks of 16 tokens each) to
    the last one received."""
    publisher = KVEventPublisher("tcp://127.0.0.1:0", key=key)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    if key is not None:
        sub.curve_publickey, sub.curve_secretkey = client_keys(key)
        sub.curve_serverkey = server_keys(key)[0]
    sub.connect(publisher.endpoint)
    events = [Stored([i.to_bytes(32, "big")], None, list(range(16)), 16, DEVICE) for i in range(16)]
    try:
        while not sub.poll(50):  # until the subscription is in place
            publisher.publish(events)
        while sub.poll(200):
            sub.recv_multipart()
        started = time.perf_counter()
        for _ in range(batches):
            publisher.publish(events)
        for _ in range(batches):
            sub.recv_multipart()
        return (time.perf_counter() - started) * 1000
    finally:
        sub.close(0)
        context.term()
        publisher.close()


def token_us(count: int) -> tuple[float, float]:
    """Microseconds to sign one peer token, and to check (and spend) one."""
    key = b"k" * 32
    started = time.perf_counter()
    tokens = [sign(key, "peer-http", "POST", "/v1/pd/prefill") for _ in range(count)]
    signed = time.perf_counter()
    spent = SpentTokens()
    assert all(
        check(key, t, "peer-http", "POST", "/v1/pd/prefill", spent=spent).name == "VALID" for t in tokens
    )
    checked = time.perf_counter()
    return (signed - started) / count * 1e6, (checked - signed) / count * 1e6


MODEL = "SmolLM2-135M-Instruct"
API_KEY, ADMIN_KEY = "sk-bench-tenant", "sk-bench-admin"


def _keyless_replica(name: str) -> Child:
    """A replica as before issue 30: no key of any kind, plain KV events on loopback."""
    port = free_port()
    command = [sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port), "--num-threads", "1"]
    command += [
        "--kv-cache-memory",
        "384MiB",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--log-level",
        "warning",
    ]
    log = Path(tempfile.mkdtemp(prefix=f"deepinfer-bench-{name}-")) / "log.txt"
    return Child(name, command, f"http://127.0.0.1:{port}", "/v1/engine_info", log)


def router_latencies(requests: int) -> dict[str, list[float]]:
    """Seconds per chat request through a keyless and a keyed router + replica, alternating
    (which side goes first alternates too), each request a prompt of its own."""
    keys = ("--api-key", API_KEY, "--admin-key", ADMIN_KEY)
    keyless, keyed = _keyless_replica("keyless"), keyed_replica("keyed", *keys)
    with running([keyless, keyed]):
        keyless_router = router("keyless-router", "--replica", keyless.url)
        # deepinfer.bench.cluster's router() passes the cluster key; the keyless one must not have it.
        at = keyless_router.command.index("--cluster-key-file")
        del keyless_router.command[at : at + 2]
        keyed_router = router("keyed-router", "--replica", keyed.url, *keys)
        with running([keyless_router, keyed_router]):
            sides = {"keyless": (keyless_router.url, {}), "keyed": (keyed_router.url, {"x-api-key": API_KEY})}
            times: dict[str, list[float]] = {name: [] for name in sides}
            with httpx.Client(timeout=300) as http:
                for i in range(-1, requests):  # the first pair warms both up, uncounted
                    words = " ".join(f"stop{i}-{j}" for j in range(60))
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"Plan a walk past {words}."}],
                        "max_tokens": 8,
                        "temperature": 0,
                    }
                    order = list(sides) if i % 2 else list(reversed(sides))
                    for name in order:
                        url, headers = sides[name]
                        started = time.perf_counter()
                        reply = http.post(url + "/v1/chat/completions", json=body, headers=headers)
                        assert reply.status_code == 200, reply.text
                        if i >= 0:
                            times[name].append(time.perf_counter() - started)
            # The keyed router's index is fed through CURVE: it must know the replica's blocks.
            metrics = httpx.get(keyed_router.url + "/metrics", headers={"x-api-key": ADMIN_KEY}, timeout=30)
            indexed = [
                line
                for line in metrics.text.splitlines()
                if line.startswith("deepinfer_router_index_blocks{")
            ]
            assert any(float(line.rsplit(" ", 1)[1]) > 0 for line in indexed), indexed
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pulls", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-kib", type=int, default=768)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--event-rounds", type=int, default=5)
    parser.add_argument("--router", type=int, default=0, metavar="N", help="chat requests per side (0: skip)")
    args = parser.parse_args()
    cluster_key_file()  # created before any child starts
    for chunk_bytes, label in ((0, "empty pull (handshake + request)"), (args.chunk_kib << 10, "KV pull")):
        chunks = args.chunks if chunk_bytes else 1
        size = max(chunk_bytes, 1)
        plain, keyed = median_pulls_ms(args.pulls, chunks, size)
        print(
            f"{label:34s} {chunks * size / 2**20:7.2f} MiB: keyless {plain:.3f} ms, "
            f"cluster key {keyed:.3f} ms ({keyed - plain:+.3f} ms)"
        )
    sign_us, check_us = token_us(20_000)
    print(f"peer token / handoff signature: sign {sign_us:.1f} us, check and spend {check_us:.1f} us")
    rounds: dict[str, list[float]] = {"plain": [], "CURVE": []}
    for _ in range(args.event_rounds):
        rounds["plain"].append(events_ms(None, args.batches))
        rounds["CURVE"].append(events_ms(b"k" * 32, args.batches))
    plain, keyed = (statistics.median(rounds[name]) for name in ("plain", "CURVE"))
    print(
        f"KV events, {args.batches} batches of 16 blocks, median of {args.event_rounds}: plain {plain:.0f} ms "
        f"(range {min(rounds['plain']):.0f}-{max(rounds['plain']):.0f}), CURVE {keyed:.0f} ms "
        f"(range {min(rounds['CURVE']):.0f}-{max(rounds['CURVE']):.0f}): x{keyed / plain:.2f}"
    )
    if args.router:
        times = router_latencies(args.router)
        summary = {}
        for name, seconds in times.items():
            seconds.sort()
            summary[name] = statistics.median(seconds)
            p90 = seconds[int(0.9 * (len(seconds) - 1))]
            print(
                f"router + replica, {name:7s}: {len(seconds)} chat requests, median {summary[name] * 1000:.0f} ms, "
                f"p90 {p90 * 1000:.0f} ms"
            )
        print(f"keyed / keyless, median latency: x{summary['keyed'] / summary['keyless']:.3f}")


if __name__ == "__main__":
    main()
