"""`deepinfer serve` over two ranks: the same completions as one process (SmolLM2 and a tiny
DeepSeek-V4 over two tensor-parallel ranks); a rank that dies takes the server to unhealthy with
errors to clients in seconds; per-rank metrics for data parallelism; SIGTERM stops every rank."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest

from deepinfer import SamplingParams
from deepinfer.distributed.topology import free_port
from tests.parallel.helpers import rank_processes
from tests.server.server_process import ServerProcess, metric_value, pid_alive, wait_until

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tp_server():
    server = ServerProcess("--tensor-parallel-size", "2", "--num-threads", "1").start()
    yield server
    server.kill()


def test_tensor_parallel_server_completes_like_one_process(tp_server, dense_llm):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    reply = httpx.post(tp_server.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert (
        reply.json()["choices"][0]["text"]
        == dense_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    )


def test_a_dead_rank_fails_requests_and_health_in_seconds(tp_server):
    [rank1] = rank_processes(tp_server.engine_pid)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": PROMPT,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=tp_server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        next(line for line in lines if '"text":"' in line)  # generating
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        rest = list(lines)
    assert time.monotonic() - killed < 10
    assert any("error" in line for line in rest)
    assert wait_until(lambda: httpx.get(tp_server.url + "/health").status_code == 503, 10)
    assert wait_until(lambda: not pid_alive(tp_server.engine_pid), 10)


@pytest.fixture(scope="module")
def dp_server(tiny_v3):
    server = ServerProcess(
        str(tiny_v3.path), "--data-parallel-size", "2", "--enable-expert-parallel", "--num-threads", "1"
    ).start()
    yield server
    server.kill()


def test_data_parallel_metrics_per_rank_and_sigterm_stops_every_rank(dp_server, tiny_v3):
    ranks = rank_processes(dp_server.engine_pid)
    assert len(ranks) == 1
    for i in range(4):
        body = {
            "model": tiny_v3.path.name,
            "prompt": [5 + i, 6, 7, 8] * 5,
            "max_tokens": 4,
            "ignore_eos": True,
        }
        assert httpx.post(dp_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(dp_server.url + "/metrics").text
    for rank in ("0", "1"):
        assert metric_value(text, "deepinfer_dp_rank_kv_cache_usage_ratio", {"dp_rank": rank}) >= 0
    assert metric_value(text, "deepinfer_dp_rank_num_requests_running", {"dp_rank": "1"}) == 0
    assert dp_server.stop(timeout_s=60) == 0, dp_server.log_tail()
    assert wait_until(
        lambda: not pid_alive(dp_server.engine_pid) and not any(pid_alive(p) for p in ranks), 10
    )


def test_tensor_parallel_server_on_deepseek_v4(tiny_v4, v4_prompts, v4_reference):
    server = ServerProcess(
        str(tiny_v4.path), "--tensor-parallel-size", "2", "--num-threads", "1", "--block-size", "4"
    ).start()
    try:
        assert len(rank_processes(server.engine_pid)) == 1
        body = {"model": tiny_v4.path.name, "prompt": v4_prompts[0], "max_tokens": 12, "temperature": 0}
        reply = httpx.post(server.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == v4_reference[2]
    finally:
        server.kill()


def test_ranks_started_by_torchrun(dense_llm):
    """torchrun starts both ranks (RANK, WORLD_SIZE, MASTER_* and its own rendezvous store in the
    environment): rank 0 serves HTTP, rank 1 is a worker; SIGTERM to torchrun stops both."""
    server = ServerProcess("--tensor-parallel-size", "2", "--num-threads", "1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    server.command = [
        *launcher,
        "--master-port",
        str(free_port()),
        "-m",
        "deepinfer.cli",
        *server.command[3:],
    ]
    server.start()
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(server.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = dense_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
        assert reply.json()["choices"][0]["text"] == expected
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
        assert wait_until(lambda: not pid_alive(server.engine_pid), 10)
    finally:
        server.kill()
