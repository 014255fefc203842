"""Issue 30, finding 6, with real servers: every chunk of a prompt in a `--kv-store` replaced with
noise under a recomputed CRC was served after a restart (`cached=2048`, a garbage answer). With
`--cluster-key-file` the chunks carry a MAC: the forged ones are misses, counted on /metrics,
the answer is the one computed cold, and the files are the engine user's alone. (The device's
prefix cache is reset in between, so only the store holds the prompt, as after a restart.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.security.test_store_files import _forge_noise, _rewrite
from tests.server.server_process import ServerProcess, metric_value, wait_until

MODEL = "SmolLM2-135M-Instruct"
CHUNK_BLOCKS = 4  # chunks of 64 tokens: a short prompt fills several
PROMPT = " ".join(f"Clause {i}: the tenant returns every key on the last day." for i in range(24))


def _complete(server: ServerProcess) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with server.client(timeout=600) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_forged_chunks_are_misses_with_a_cluster_key(tmp_path: Path) -> None:
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    key_file.chmod(0o600)
    store = tmp_path / "kv-store"
    server = ServerProcess(
        "--kv-store", str(store), "--kv-chunk-blocks", str(CHUNK_BLOCKS), "--cluster-key-file", str(key_file)
    ).start()
    try:
        cold = _complete(server)
        full_chunks = (cold["usage"]["prompt_tokens"] - 1) // (CHUNK_BLOCKS * 16)
        assert full_chunks >= 3, cold["usage"]
        assert wait_until(lambda: len(list(store.rglob("*.kv"))) >= full_chunks, 60)  # written behind
        for path in store.rglob("*.kv"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            _rewrite(path, _forge_noise)
        with server.client() as client:  # only the store holds the prompt now
            assert client.post("/reset_prefix_cache").status_code == 200
        warm = _complete(server)
        with server.client() as client:
            metrics = client.get("/metrics").text
    finally:
        assert server.stop() == 0, server.log_tail()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, warm["usage"]
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert metric_value(metrics, "deepinfer_kv_store_forged_chunks_total") >= 1
    assert metric_value(metrics, "deepinfer_kv_store_corrupt_chunks_total") == 0
    assert any("failed authentication" in line for line in server.lines), server.log_tail()
