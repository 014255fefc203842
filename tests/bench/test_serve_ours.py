"""`bench serve` against our real `deepinfer serve`: fields present, counts adding up, cache hits seen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.bench.serve_command import ServeOptions, run_serve
from tests.server.server_process import ServerProcess


@pytest.fixture(scope="module")
def server():
    process = ServerProcess().start()
    yield process
    process.stop()


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_bench_serve_against_our_server(server, tmp_path: Path, api: str) -> None:
    result_path = tmp_path / "result.json"
    options = ServeOptions(
        base_url=server.url,
        api=api,
        dataset="agent",
        num_prompts=6,
        input_len=200,
        output_len=8,
        max_concurrency=3,
        agent_turns=2,
        show_progress=False,
        result_json=str(result_path),
    )
    run_serve(options)
    (run,) = json.loads(result_path.read_text())["runs"]
    summary, requests = run["summary"], run["requests"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens_source"] == "usage"
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in requests) == 6 * 8
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    # Agent turns resend the shared system prompt: our server reports prefix-cache hits in usage.
    assert summary["prefix_cache_hit_rate"] > 0.2
    assert summary["ttft_ms"]["count"] == 6 and summary["ttft_ms"]["p50"] > 0
