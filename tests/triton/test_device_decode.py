"""deepinfer/bench/device_decode.py (the decode timing of deepinfer/bench/device_check.sh) on a tiny shape on the CPU,
so that its one run on a GPU machine does not fail on a mistake a CPU could have found."""

from __future__ import annotations

from deepinfer.bench.device_decode import TINY, main


def test_tiny_decode_bench_runs_and_agrees_with_the_references(tmp_path, device):
    out = tmp_path / "decode.json"
    report = main(
        ["--device", device, "--tiny", "--dtype", "float32", "--batches", "1,3", "--context", "40",
         "--steps", "1", "--out", str(out)]
    )  # fmt: skip
    check = report["reference_check"]
    assert check["greedy_equal"] and check["max_logit_diff"] < 1e-4
    assert [r["batch"] for r in report["results"]] == [1, 3]
    one, three = report["results"]
    kv_per_sequence = TINY.layers * 2 * TINY.kv_heads * TINY.head_dim * 40 * 4
    assert three["bytes_per_step"] - one["bytes_per_step"] == 2 * (kv_per_sequence + TINY.hidden * 4)
    assert out.read_text().startswith("{")
