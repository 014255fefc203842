"""A server stopped (SIGTERM) right after a long answer and restarted on the same KV store serves
every full chunk of that prompt as a hit: the graceful stop flushed the whole write-behind queue."""

from __future__ import annotations

from pathlib import Path

from tests.server.server_process import ServerProcess

# About 1,000 prompt tokens in chunks of 4 blocks (64 tokens): 15 full storage chunks, as many as
# the report in which the stop lost the last of 14 chunks of 256 tokens, for a quarter of the
# prefill.
CHUNK_BLOCKS = 4
CHUNK_TOKENS = CHUNK_BLOCKS * 16
DOCUMENT = " ".join(
    f"Clause {i}: the tenant keeps the premises clean and returns every key." for i in range(64)
)
STORE_ARGS = ("--kv-chunk-blocks", str(CHUNK_BLOCKS))


def _ask(server: ServerProcess) -> dict:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": f"{DOCUMENT}\n\nSummarize the clauses."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    with server.client(timeout=600) as client:
        response = client.post("/v1/chat/completions", json=body, headers={"x-traffic-class": "agent"})
    assert response.status_code == 200, response.text
    return response.json()


def test_prefix_survives_a_server_restart(tmp_path: Path) -> None:
    store = tmp_path / "kv-store"
    first = ServerProcess("--kv-store", str(store), *STORE_ARGS, "--log-level", "info").start()
    try:
        cold = _ask(first)
    finally:
        assert first.stop() == 0, first.log_tail()  # SIGTERM right after the answer
    assert any("0 dropped by the deadline" in line for line in first.lines), first.log_tail()
    assert (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) < CHUNK_TOKENS
    assert any(store.rglob("*")), "nothing was written to the store"

    second = ServerProcess("--kv-store", str(store), *STORE_ARGS).start()
    try:
        warm = _ask(second)
    finally:
        assert second.stop() == 0, second.log_tail()
    prompt_tokens = warm["usage"]["prompt_tokens"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full chunk of the prompt comes back from the store; only the tail is recomputed.
    assert cached == ((prompt_tokens - 1) // CHUNK_TOKENS) * CHUNK_TOKENS >= 14 * CHUNK_TOKENS, warm["usage"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
