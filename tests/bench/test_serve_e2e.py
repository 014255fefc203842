"""`bench serve` against a real streaming HTTP server (tests/bench/streaming_server.py)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.bench.serve import session_start_times
from deepinfer.bench.serve_command import ServeOptions, format_serve_summary, run_serve
from tests.bench.streaming_server import MODEL_ID, ServerBehaviour, running_server

REPO = Path(__file__).resolve().parents[2]


def _options(base_url: str, **overrides) -> ServeOptions:
    defaults = dict(
        base_url=base_url,
        num_prompts=12,
        input_len=40,
        output_len=8,
        max_concurrency=4,
        show_progress=False,
    )
    return ServeOptions(**{**defaults, **overrides})


def test_chat_run_writes_a_complete_result(tmp_path: Path) -> None:
    result_path = tmp_path / "result.json"
    with running_server() as (url, state):
        run_serve(_options(url, result_json=str(result_path), plot_dir=str(tmp_path / "plots")))
    result = json.loads(result_path.read_text())

    assert result["benchmark"] == "serve"
    assert {"command", "date", "machine", "versions", "config", "runs"} <= result.keys()
    assert result["machine"]["usable_cores"] >= 1 and result["versions"]["httpx"]
    assert result["config"]["model"] == MODEL_ID  # discovered from GET /v1/models
    assert "api_key" not in result["config"]
    (run,) = result["runs"]
    summary, requests = run["summary"], run["requests"]

    assert summary["completed"] == 12 and summary["failed"] == 0 and len(requests) == 12
    assert summary["output_tokens_source"] == "usage"
    assert summary["total_output_tokens"] == 12 * 8 == sum(r["output_tokens"] for r in requests)
    assert summary["input_tokens_source"] == "usage"
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests) == 12 * 40
    assert summary["output_throughput"] == pytest.approx(96 / summary["duration_s"])
    assert summary["request_throughput"] == pytest.approx(12 / summary["duration_s"])
    assert summary["total_token_throughput"] == pytest.approx((96 + 480) / summary["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert summary[key]["count"] == 12
        assert summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"] <= summary[key]["max"]
    # Every request streamed 8 chunks: 7 gaps each.
    assert summary["itl_ms"]["count"] == 12 * 7
    for r in requests:
        assert r["content_chunks"] == 8
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 7)
    # The server saw the warm-up plus every request, each with ignore_eos and max_tokens.
    assert state.requests == 13
    assert all(body["ignore_eos"] is True and body["max_tokens"] == 8 for body in state.bodies[1:])
    assert all(body["stream_options"] == {"include_usage": True} for body in state.bodies)
    assert summary["goodput"] is None  # no SLO given
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 4 | ∞ | 12/0 |" in format_serve_summary(result)


def test_agent_sessions_hit_the_prefix_cache_random_prompts_do_not() -> None:
    with running_server() as (url, _):
        agent = run_serve(_options(url, dataset="agent", num_prompts=12, input_len=200, agent_user_len=20))
    with running_server() as (url, _):
        random = run_serve(_options(url, dataset="random", num_prompts=12, input_len=200))
    agent_summary, random_summary = agent["runs"][0]["summary"], random["runs"][0]["summary"]
    assert agent_summary["requests_reporting_cached_tokens"] == 12
    assert agent_summary["prefix_cache_hit_rate"] > 0.6
    assert random_summary["prefix_cache_hit_rate"] < 0.1
    cached = sum(r["cached_tokens"] for r in agent["runs"][0]["requests"])
    assert agent_summary["cached_prompt_tokens"] == cached
    # Turns of a session went out in order, each after the previous one finished.
    by_session: dict[int, list[dict]] = {}
    for r in agent["runs"][0]["requests"]:
        by_session.setdefault(r["session_id"], []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for earlier, later in itertools.pairwise(turns):
            assert later["start_s"] >= earlier["start_s"] + earlier["e2e_s"] - 1e-6


def test_without_usage_output_tokens_are_counted_from_chunks() -> None:
    with running_server(ServerBehaviour(send_usage=False)) as (url, _):
        result = run_serve(_options(url, api="completions", output_len=6))
    summary = result["runs"][0]["summary"]
    assert summary["output_tokens_source"] == "chunks"
    assert summary["total_output_tokens"] == 12 * 6
    assert summary["input_tokens_source"] == "approx_words"
    assert summary["prefix_cache_hit_rate"] is None and summary["cached_prompt_tokens"] is None


def test_anthropic_messages_stream_with_cache_reads() -> None:
    with running_server() as (url, state):
        result = run_serve(_options(url, api="messages", dataset="agent", input_len=100, agent_user_len=10))
    run = result["runs"][0]
    summary = run["summary"]
    assert summary["completed"] == 12 and summary["output_tokens_source"] == "usage"
    assert summary["total_output_tokens"] == 96
    # prompt = input_tokens + cache_read_input_tokens: the whole prompt the server counted.
    server_words = sum(
        len(body["system"].split()) + sum(len(m["content"].split()) for m in body["messages"])
        for body in state.bodies[1:]
    )
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in run["requests"]) == server_words
    assert summary["prefix_cache_hit_rate"] > 0.4
    assert all("system" in body for body in state.bodies[1:])


def test_failed_requests_are_counted_and_explained() -> None:
    # The warm-up is request 1; requests 3, 6, 9 and 12 of the 12 measured ones fail.
    with running_server(ServerBehaviour(fail_every=3)) as (url, _):
        result = run_serve(_options(url))
    summary = result["runs"][0]["summary"]
    assert summary["completed"] + summary["failed"] == 12
    assert summary["failed"] == 4
    assert any("HTTP 500" in error and "injected failure" in error for error in summary["errors"])
    assert summary["total_output_tokens"] == summary["completed"] * 8


def test_goodput_follows_the_slos() -> None:
    behaviour = ServerBehaviour(first_token_delay_s=0.02, chunk_delay_s=0.002)
    with running_server(behaviour) as (url, _):
        loose = run_serve(_options(url, slo_ttft_ms=10_000, slo_tpot_ms=10_000))
        strict = run_serve(_options(url, slo_ttft_ms=1, slo_tpot_ms=10_000))
    loose_summary, strict_summary = loose["runs"][0]["summary"], strict["runs"][0]["summary"]
    assert loose_summary["good_requests"] == 12
    assert loose_summary["goodput"] == pytest.approx(12 / loose_summary["duration_s"])
    assert strict_summary["good_requests"] == 0 and strict_summary["goodput"] == 0
    assert strict_summary["ttft_ms"]["min"] >= 20


def test_without_ignore_eos_the_server_may_stop_early() -> None:
    with running_server() as (url, state):
        result = run_serve(_options(url, ignore_eos=False, extra_body={"top_k": 1}))
    assert result["runs"][0]["summary"]["total_output_tokens"] == 12 * 4
    assert all("ignore_eos" not in body and body["top_k"] == 1 for body in state.bodies)


def test_concurrency_sweep_gives_one_run_per_level(tmp_path: Path) -> None:
    with running_server(ServerBehaviour(chunk_delay_s=0.002)) as (url, _):
        result = run_serve(_options(url, sweep_concurrency=[1, 4], plot_dir=str(tmp_path), num_cards=2))
    assert [run["summary"]["max_concurrency"] for run in result["runs"]] == [1, 4]
    one, four = (run["summary"] for run in result["runs"])
    assert one["mean_concurrency"] <= 1.05
    assert four["mean_concurrency"] > 1.5
    assert four["output_throughput_per_card"] == pytest.approx(four["output_throughput"] / 2)
    assert (tmp_path / "throughput_vs_concurrency.png").exists()


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    starts = session_start_times(2000, request_rate=50.0, seed=7)
    assert starts == session_start_times(2000, request_rate=50.0, seed=7)
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert starts[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert session_start_times(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_request_rate_spreads_the_requests() -> None:
    with running_server() as (url, _):
        result = run_serve(_options(url, num_prompts=6, max_concurrency=None, request_rate=20.0))
    starts = sorted(r["start_s"] for r in result["runs"][0]["requests"])
    expected = session_start_times(6, 20.0, 0)
    # Never before its time; late only by the load generator's own stalls, which reach tens of
    # milliseconds while the server holds both cores of the machine (70 ms in one full run).
    lags = [start - planned for start, planned in zip(starts, expected, strict=True)]
    assert all(-0.01 <= lag <= 0.15 for lag in lags), lags
    assert starts[-1] - starts[0] >= 0.8 * (expected[-1] - expected[0])


def test_think_time_separates_a_sessions_turns() -> None:
    """Each later turn of a session starts its think time after the previous turn's answer ended."""
    with running_server() as (url, _):
        result = run_serve(
            _options(
                url, dataset="agent", num_prompts=6, agent_turns=3, max_concurrency=None, think_time_s=0.3
            )
        )
    requests = result["runs"][0]["requests"]
    assert len(requests) == 6 and all(r["success"] for r in requests)
    by_session: dict[int, list[dict]] = {}
    for r in requests:
        by_session.setdefault(r["session_id"], []).append(r)
    assert len(by_session) == 2
    for turns in by_session.values():
        turns.sort(key=lambda r: r["start_s"])
        for before, after in itertools.pairwise(turns):
            assert after["start_s"] - (before["start_s"] + before["e2e_s"]) >= 0.3 - 0.01
    with pytest.raises(ValueError, match="think_time_s"):
        run_serve(_options("http://127.0.0.1:9", model="m", think_time_s=-1.0, warmup=False))


def test_command_line_run_and_clear_errors(tmp_path: Path) -> None:
    result_path = tmp_path / "cli.json"
    with running_server() as (url, _):
        done = subprocess.run(
            [sys.executable, "-m", "deepinfer.bench", "serve", "--base-url", url, "--num-prompts", "4",
             "--input-len", "10", "--output-len", "3", "--max-concurrency", "2", "--disable-tqdm",
             "--result-json", str(result_path)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| 2 | ∞ | 4/0 |" in done.stdout
    saved = json.loads(result_path.read_text())
    assert "deepinfer.bench serve --base-url" in saved["command"]
    assert saved["runs"][0]["summary"]["total_output_tokens"] == 12

    unreachable = subprocess.run(
        [sys.executable, "-m", "deepinfer.bench", "serve", "--base-url", "http://127.0.0.1:9",
         "--model", "m", "--num-prompts", "1", "--disable-tqdm"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert unreachable.returncode == 2
    assert "warm-up request to http://127.0.0.1:9/v1/chat/completions failed" in unreachable.stderr
