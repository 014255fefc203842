"""Two "nodes" on loopback: node 1 is a `deepinfer serve --nnodes 2 --node-rank 1` process of its
own, node 0 an engine in this process; they meet at --master-addr/--master-port, and step plans
travel over torch.distributed (gloo) instead of shared memory. Same greedy tokens and logits as
one process; closing node 0 ends node 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.distributed.topology import free_port
from tests.parallel.helpers import DEEPSEEK_PARAMS
from tests.parallel.test_tensor_parallel import PARAMS, PROMPTS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def start_node1(model: str | None, options: list[str], port: int) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "deepinfer.cli", "serve", *([model] if model else [])]
    command += [*options, "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)]
    command += ["--master-addr", "127.0.0.1", "--log-level", "warning"]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _two_nodes(model: str | None, options: dict, flags: list[str]):
    port = free_port()
    node1 = start_node1(model, flags, port)
    try:
        llm = LLM(model=model, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, **options)
    except BaseException:
        node1.kill()
        raise
    return llm, node1


def _closed(llm: LLM, node1: subprocess.Popen[str]) -> None:
    llm.close()
    try:
        code = node1.wait(60)
    finally:
        node1.kill()
    assert code == 0, node1.stdout.read() if node1.stdout else ""


def test_tensor_parallel_over_two_nodes(dense_llm):
    options = {"tensor_parallel_size": 2, "num_threads": 1, "kv_cache_memory": 64 << 20}
    flags = ["--tensor-parallel-size", "2", "--num-threads", "1", "--kv-cache-memory", "64MiB"]
    llm, node1 = _two_nodes(None, options, flags)
    try:
        assert not llm.engine.core.parallel.topology.local_channel
        expected = [o.outputs[0].token_ids for o in dense_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
        ids = dense_llm.get_tokenizer().encode(PROMPTS[2])
        assert (llm.engine.core.score(ids) - dense_llm.engine.core.score(ids)).abs().max().item() < 1e-4
    finally:
        _closed(llm, node1)


def test_data_and_expert_parallel_over_two_nodes(tiny_v3, prompts, reference):
    options = {"data_parallel_size": 2, "enable_expert_parallel": True, "num_threads": 1, "num_blocks": 128}
    flags = [
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--num-threads",
        "1",
        "--num-blocks",
        "128",
    ]
    llm, node1 = _two_nodes(str(tiny_v3.path), options, flags)
    try:
        outputs = llm.generate(prompts, DEEPSEEK_PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference[0]
        assert all(llm.engine.core.balancer.num_routed)
    finally:
        _closed(llm, node1)
