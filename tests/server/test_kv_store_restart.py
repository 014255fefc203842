"""A server stopped (SIGTERM) right after a long answer and restarted on the same KV store serves
every full chunk of that prompt as a hit: the graceful stop flushed the whole write-behind queue."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.server.server_process import ServerProcess, wait_until

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


# Issue 30, finding 12, exactly its shape: 16-token blocks in chunks of 16 (256 tokens), one
# completion of ~3,750 prompt tokens and 1 output token, then SIGTERM to the whole process group
# at once (as systemd and `kill -- -PGID` send it): the engine used to die of the signal with the
# last chunks still in its write-behind queue (2,560 of 3,584 tokens cached after the restart).
LONG_PROMPT = " ".join(
    f"Item {i}: the quick brown fox jumps over the lazy dog number {i * 7}." for i in range(183)
)
FULL_CHUNK_TOKENS = 256


def _complete(server: ServerProcess) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0}
    with server.client(timeout=600) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_sigterm_to_the_process_group_keeps_every_full_chunk(tmp_path: Path) -> None:
    args = ("--kv-store", str(tmp_path / "kv-store"), "--block-size", "16", "--kv-chunk-blocks", "16")
    first = ServerProcess(*args, "--log-level", "info").start()
    try:
        cold = _complete(first)
        assert first.process is not None
        os.killpg(first.process.pid, signal.SIGTERM)  # the API process and the engine alike
        assert first.process.wait(120) == 0, first.log_tail()
    finally:
        first.kill()
    # The engine flushed its queue instead of dying of the signal (read once its output is in).
    assert wait_until(lambda: any("0 dropped by the deadline" in x for x in first.lines), 10), (
        first.log_tail()
    )
    full_chunks = (cold["prompt_tokens"] - 1) // FULL_CHUNK_TOKENS
    assert full_chunks == 14, cold  # the reported shape: ~3,750 tokens, 14 full chunks

    second = ServerProcess(*args).start()
    try:
        warm = _complete(second)
    finally:
        assert second.stop() == 0, second.log_tail()
    assert warm["prompt_tokens_details"]["cached_tokens"] == full_chunks * FULL_CHUNK_TOKENS, warm
