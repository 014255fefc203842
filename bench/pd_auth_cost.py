"""What the cluster key costs a direct KV pull: the same leases pulled over loopback with and
without the HMAC handshake (security/peer_auth.py), median of many pulls; and what CURVE costs
the KV events (the time a subscriber takes to receive a burst of batches, plain and CURVE).

    .venv/bin/python -m bench.pd_auth_cost [--pulls 200] [--chunks 8] [--chunk-kib 768] [--batches 2000]

The default KV pull is 8 chunks of 768 KiB (6 MiB: SmolLM2-135M's fp32 KV of 16-block chunks is
about 2.2 MiB a chunk; the size matters less than the count of pulls, one handshake each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import zmq

from deepinfer.engine.kv_cache.events import DEVICE, Stored
from deepinfer.engine.kv_events import KVEventPublisher
from deepinfer.engine.kv_transfer import KVPuller, KVTransferServer
from deepinfer.security.curve import client_keys, server_keys
from deepinfer.sequence import KVSource

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pulls", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-kib", type=int, default=768)
    parser.add_argument("--batches", type=int, default=2000)
    args = parser.parse_args()
    for chunk_bytes, label in ((0, "empty pull (handshake + request)"), (args.chunk_kib << 10, "KV pull")):
        chunks = args.chunks if chunk_bytes else 1
        size = max(chunk_bytes, 1)
        plain, keyed = median_pulls_ms(args.pulls, chunks, size)
        print(
            f"{label:34s} {chunks * size / 2**20:7.2f} MiB: keyless {plain:.3f} ms, "
            f"cluster key {keyed:.3f} ms ({keyed - plain:+.3f} ms)"
        )
    plain, keyed = events_ms(None, args.batches), events_ms(b"k" * 32, args.batches)
    print(
        f"KV events, {args.batches} batches of 16 blocks: plain {plain:.0f} ms, CURVE {keyed:.0f} ms "
        f"({1000 * (keyed - plain) / args.batches:+.1f} us a batch)"
    )


if __name__ == "__main__":
    main()
