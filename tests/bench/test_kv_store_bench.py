"""`bench kvstore` measures a store hit: the process that writes the prefix runs the measuring
engine's KV options, so a non-default KV dtype finds its chunks instead of timing a cold prefill."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.bench.cli import main


def test_a_bf16_kv_cache_reads_its_prefix_back_from_the_store(tmp_path: Path) -> None:
    result = tmp_path / "kvstore.json"
    argv = ["kvstore", "--prefix-len", "320", "--suffix-len", "16", "--repeats", "1", "--kv-cache-dtype", "bfloat16",
            "--kv-store", str(tmp_path / "store"), "--result-json", str(result), "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads(result.read_text())["store_metrics"]
    assert metrics["bytes_read"] > 0, metrics
