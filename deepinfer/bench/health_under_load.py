"""How long `/health` takes while a huge prompt is read, parsed and tokenized (issue 30: < 100 ms).

One `deepinfer serve` (one engine thread, an API key); each round uploads a ~10 MB prompt (in
1 MiB pieces, as a client on a fast link would) to /v1/completions and then /v1/chat/completions
while another connection asks /health back to back (10 ms apart), from the first byte sent
until the big request is answered (a 400: the prompt is far past the context, once counted).
Prints the /health latencies' p50, p99 and max per API, and the big request's own time; and
the same with nothing else sent (`--idle-s` before each round), the machine's own noise.

    .venv/bin/python -m deepinfer.bench.health_under_load [--rounds 5] [--megabytes 10] [--api chat/completions]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx

from deepinfer.bench.cluster import replica, running

KEY = "sk-bench-health"
MODEL = "SmolLM2-135M-Instruct"
PIECE = 1 << 20
APIS = ("completions", "chat/completions")


def _body(api: str, words: int) -> bytes:
    text = "word " * words
    if api == "completions":
        return json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    ).encode()


def _poll(url: str, done: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        while not done.is_set():
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append((time.perf_counter() - started) * 1000)
            done.wait(0.01)


def idle_round(url: str, seconds: float) -> list[float]:
    """/health latencies (ms) with nothing else sent: the machine's own noise."""
    done = threading.Event()
    latencies: list[float] = []
    poller = threading.Thread(target=_poll, args=(url, done, latencies))
    poller.start()
    time.sleep(seconds)
    done.set()
    poller.join()
    return latencies


def one_round(url: str, api: str, body: bytes) -> tuple[list[float], float, int]:
    """/health latencies (ms) while `body` is sent and answered; the big request's ms and status."""
    done = threading.Event()
    latencies: list[float] = []

    def pieces() -> Iterator[bytes]:
        for at in range(0, len(body), PIECE):
            yield body[at : at + PIECE]

    poller = threading.Thread(target=_poll, args=(url, done, latencies))
    started = time.perf_counter()
    poller.start()
    try:
        reply = httpx.post(
            f"{url}/v1/{api}",
            content=pieces(),
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
            timeout=600,
        )
    finally:
        done.set()
        poller.join()
    return latencies, (time.perf_counter() - started) * 1000, reply.status_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=10.0)
    parser.add_argument("--idle-s", type=float, default=5.0, help="/health alone before each round")
    parser.add_argument("--api", choices=APIS, action="append", help="default: both")
    args = parser.parse_args()
    words = int(args.megabytes * 1e6 / 5)
    bodies = {api: _body(api, words) for api in args.api or APIS}
    with running([replica("health", "--api-key", KEY)]) as (server,):
        results: dict[str, list[float]] = {"idle": [], **{api: [] for api in bodies}}
        big: dict[str, list[float]] = {api: [] for api in bodies}
        for _ in range(args.rounds):
            results["idle"] += idle_round(server.url, args.idle_s)
            for api, body in bodies.items():
                latencies, total_ms, status = one_round(server.url, api, body)
                assert status == 400, status  # past the context: counted, then refused
                results[api] += latencies
                big[api].append(total_ms)
    for name, latencies in results.items():
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        what = (
            f"/v1/{name}, {len(bodies[name]) / 1e6:.1f} MB x {args.rounds}"
            if name in bodies
            else f"idle, {args.idle_s:.0f} s x {args.rounds}"
        )
        line = (
            f"{what:34s} /health n={len(latencies)} p50 {statistics.median(latencies):.1f} ms, "
            f"p99 {p99:.1f} ms, max {latencies[-1]:.1f} ms"
        )
        if name in big:
            line += f"; the big request {statistics.median(big[name]) / 1000:.1f} s (median)"
        print(line)


if __name__ == "__main__":
    main()
