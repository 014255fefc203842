"""deepinfer/bench/engine_decode.py at a tiny shape: the engine's decode with graphs gives the
eager run's tokens (on the CPU the capture is ReplayByCall; on CUDA real graphs). On CUDA a batch
padded to its graph's size may take another GEMM kernel than the eager batch, so only batch 1
(never padded) must agree bit for bit there."""

from __future__ import annotations

import torch

from deepinfer.bench import engine_decode
from tests.triton.replay import ReplayByCall


def test_engine_decode_bench_tiny(device, monkeypatch):
    if device == "cpu":
        monkeypatch.setattr(engine_decode, "CudaGraphCapture", ReplayByCall)
    argv = ["--shape", "tiny", "--device", device, "--dtype", "float32", "--batches", "1,3"]
    report = engine_decode.main([*argv, "--context", "40", "--steps", "2"])
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for result in report["results"]:
        assert result["tokens_equal"] or (device != "cpu" and result["batch"] > 1), result
        assert result["eager_ms"] > 0 and result["graph_ms"] > 0
    assert torch.tensor([len(t) for t in report["results"][1]["first_tokens"]]).eq(3).all()
