"""Issue 30, finding 11 (the stores' part): with its Redis down, a server answered clients with the
Redis client's error text, which names the store's internal host and port, and the KV store's
failures showed nowhere on /metrics."""

from __future__ import annotations

import socket

from tests.server.server_process import ServerProcess, metric_value

MODEL = "SmolLM2-135M-Instruct"
PROMPT = " ".join(f"Clause {i}: the tenant returns every key on the last day." for i in range(12))


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_dead_redis_store_is_no_client_error_and_shows_on_metrics() -> None:
    port = _unused_port()  # nothing listens there: the KV store and the response store are down
    server = ServerProcess("--kv-store", f"redis://127.0.0.1:{port}/0", "--kv-chunk-blocks", "1").start()
    try:
        with server.client(timeout=300) as client:
            completion = client.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            )
            stored = client.post(
                "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4}
            )
            metrics = client.get("/metrics").text
    finally:
        assert server.stop() == 0, server.log_tail()
    # The KV store's failures are misses: the completion is served.
    assert completion.status_code == 200, completion.text
    # The response store's are a 503 in the API's shape that says so, and names no address.
    assert stored.status_code == 503, stored.text
    assert stored.json()["error"]["code"] == "response_store_unavailable"
    for reply in (completion, stored):
        assert str(port) not in reply.text and "127.0.0.1" not in reply.text, reply.text
    assert metric_value(metrics, "deepinfer_kv_store_errors_total") >= 1
