from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.bench.peers import PeerOutcome, PeersOptions, format_peers, our_command, run_peers
from deepinfer.bench.report import (
    markdown_table,
    provenance,
    read_json,
    replace_marked_section,
    write_json,
)


def test_markdown_table_formats_and_escapes_cells() -> None:
    table = markdown_table(["a", "b", "c"], [[1234, 0.5, None], ["x|y", "two\nlines", True]])
    assert table.splitlines() == [
        "| a | b | c |",
        "| --- | --- | --- |",
        "| 1,234 | 0.50 | — |",
        "| x\\|y | two lines | True |",
    ]


def test_marked_section_is_replaced_and_the_rest_kept(tmp_path: Path) -> None:
    doc = tmp_path / "bench.md"
    doc.write_text("# Title\n\nHand-written intro.\n")
    replace_marked_section(doc, "peers", "first table")
    replace_marked_section(doc, "peers", "second table")
    text = doc.read_text()
    assert text.startswith("# Title\n\nHand-written intro.\n")
    assert text.count("<!-- BEGIN peers -->") == 1 and text.count("<!-- END peers -->") == 1
    assert "second table" in text and "first table" not in text
    replace_marked_section(tmp_path / "new.md", "x", "body")
    assert (tmp_path / "new.md").read_text() == "<!-- BEGIN x -->\nbody\n<!-- END x -->\n"


def test_json_round_trip_and_clear_errors(tmp_path: Path) -> None:
    path = write_json(tmp_path / "deep" / "r.json", {"a": 1, **provenance(["prog", "--x"])})
    data = read_json(path)
    assert data["a"] == 1 and data["command"] == "prog --x" and data["versions"]["deepinfer"]
    with pytest.raises(ValueError, match="not found"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        write_json(tmp_path / "nan.json", {"x": float("nan")})


def _summary(throughput: float, ttft: float, tpot: float) -> dict:
    return {
        "output_throughput": throughput,
        "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
        "tpot_ms": {"p50": tpot},
    }


def test_peer_table_gives_ratios_to_us_and_lists_the_unavailable() -> None:
    outcomes = [
        PeerOutcome("deepinfer", "measured", "", "0.1.0", "serve", _summary(100.0, 50.0, 10.0)),
        PeerOutcome("llama.cpp", "measured", "slots", "b1", "llama-server", _summary(250.0, 25.0, 5.0)),
        PeerOutcome("transformers", "not available", "no wheel"),
    ]
    header = {
        **provenance(["deepinfer", "bench", "peers"]),
        "model": "m.gguf",
    }
    text = format_peers(outcomes, PeersOptions(), header)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 250.00 | 2.50× | 25.00 | 0.50× | 50.00 | 5.00 | 0.50× |" in rows["llama.cpp"]
    assert "| not available | — | — |" in rows["transformers"] and "no wheel" in rows["transformers"]
    assert "Command: `deepinfer bench peers`" in text
    assert "- llama.cpp: b1; `llama-server`" in text


def test_run_peers_reports_a_peer_that_cannot_start(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    result = tmp_path / "peers.json"
    options = PeersOptions(
        peers=["llama.cpp"],
        llama_server=str(tmp_path / "no-such-llama-server"),
        doc=str(doc),
        result_json=str(result),
        show_progress=False,
    )
    report = run_peers(options)
    assert not report.any_measured
    (outcome,) = report.outcomes
    assert outcome.status == "failed" and "FileNotFoundError" in outcome.detail
    assert "| llama.cpp | failed |" in doc.read_text()
    saved = json.loads(result.read_text())
    assert saved["peers"][0]["status"] == "failed" and saved["model"].endswith(".gguf")
    with pytest.raises(ValueError, match="unknown vllm"):
        run_peers(PeersOptions(peers=["vllm"], doc=None))


def test_offline_peer_runs_the_server_workload_in_process(default_model_path: Path) -> None:
    from deepinfer.bench.datasets import build_dataset
    from deepinfer.bench.peer_offline import run_offline
    from deepinfer.bench.serve import summarize_run
    from deepinfer.bench.stats import Slo

    dataset = build_dataset("random", 3, 0, 24, 6)
    outcome = run_offline(default_model_path, dataset, max_concurrency=2, threads=2)
    summary = summarize_run(outcome, Slo())
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert [r.output_tokens for r in outcome.results] == [6, 6, 6]
    assert all(len(r.itl_s) == 5 and r.ttft_s > 0 and r.e2e_s >= r.ttft_s for r in outcome.results)
    # Concurrency 2: the third request starts only after one of the first two has finished.
    first_done = min(r.start_s + r.e2e_s for r in outcome.results[:2])
    assert outcome.results[2].start_s >= first_done


def test_our_server_reads_the_model_every_peer_reads(tmp_path: Path) -> None:
    # A --model-gguf of user shapes must reach our server too, not only llama.cpp and vLLM.
    gguf = tmp_path / "llama-3.2-1b-Q4_K_M.gguf"
    options = PeersOptions(model_gguf=str(gguf), threads=3, port=18999)
    command = our_command(options, gguf, ("--kv-cache-dtype", "bfloat16"))
    serve = command.index("serve")
    assert command[serve + 1] == str(gguf)
    assert command[command.index("--num-threads") + 1] == "3"
    assert command[command.index("--port") + 1] == "18999"
    assert command[-2:] == ["--kv-cache-dtype", "bfloat16"]


def test_a_long_context_run_reaches_every_server(tmp_path: Path) -> None:
    # 32k prompts on a model trained to 8k: the context to every server, the scaling to the GGUF ones.
    from deepinfer.bench.peers import _llama_rope_flags

    yarn = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}'
    options = PeersOptions(max_model_len=32768, rope_scaling=yarn)
    gguf, folder = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF")
    folder.mkdir()
    on_gguf, on_dir = our_command(options, gguf), our_command(options, folder)
    assert on_gguf[on_gguf.index("--max-model-len") + 1] == "32768"
    assert on_gguf[on_gguf.index("--rope-scaling") + 1] == yarn
    assert on_dir[on_dir.index("--max-model-len") + 1] == "32768" and "--rope-scaling" not in on_dir
    assert "--max-model-len" not in our_command(PeersOptions(), gguf)
    assert _llama_rope_flags(yarn) == [
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "4.0",
        "--yarn-orig-ctx",
        "8192",
    ]
    assert _llama_rope_flags(None) == []
    with pytest.raises(ValueError, match="llama3"):
        _llama_rope_flags('{"rope_type": "llama3", "factor": 8.0}')


def test_servers_are_asked_for_the_temperature_the_run_names() -> None:
    from deepinfer.bench.peers import _serve_options

    assert _serve_options(PeersOptions(), "http://x", {}).temperature == 0.0
    assert _serve_options(PeersOptions(temperature=1.0), "http://x", {}).temperature == 1.0
