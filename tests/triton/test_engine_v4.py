"""A tiny DeepSeek-V4 through the engine on the Triton backend (interpreted on the CPU): its sparse
attention runs kernels/triton/sparse_attention.py and its routed experts kernels/triton/fused_moe.py,
and the greedy tokens equal the torch path's, batched, in prefill chunks of 7 and over a prefix hit."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kernels.triton import fused_moe as fused_moe_module
from deepinfer.kernels.triton import sparse_attention as sparse_module
from tests.deepseek_v4.tiny_v4 import build_v4, tiny_config

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Sliding, CSA (m=4, top-3), HCA (m=8), window 8: every layer type, hash and learned routing."""
    return build_v4(tmp_path_factory.mktemp("v4_triton"), tiny_config, seed=0)


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or kernel(*a))
    return calls


def test_tiny_v4_greedy_equals_cpu_backend(checkpoint, device, monkeypatch):
    attention_calls = _counting(monkeypatch, sparse_module, "sparse_attention_with_sink")
    moe_calls = _counting(monkeypatch, fused_moe_module, "expert_pairs")
    generator = torch.Generator().manual_seed(1)
    vocab = checkpoint.config["vocab_size"]
    base = torch.randint(3, vocab, (19,), generator=generator).tolist()
    # the second prompt shares base's first 16 tokens: a prefix hit once base is cached
    prompts = [base, base[:16] + torch.randint(3, vocab, (5,), generator=generator).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(
        model=str(checkpoint.path), dtype="float32", block_size=BLOCK, num_blocks=64, num_threads=1,
        prefill_chunk_size=7,
    )  # fmt: skip
    cpu = LLM(attention_backend="cpu_paged", device="cpu", **options)
    assert cpu.engine.core.runner.backend.name == "model"
    expected = [
        list(o.outputs[0].token_ids)
        for o in cpu.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert not attention_calls and not moe_calls  # the torch path calls no Triton kernel

    llm = LLM(attention_backend="triton", device=device, **options)
    assert llm.engine.core.runner.backend.name == "triton"
    (first,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert list(first.outputs[0].token_ids) == expected[0]
    # 8 steps (prefill chunks of 7, 7 and 5 tokens, then 5 decodes), each through the 5 layers
    # (2 routed by the hash table, 3 by the learned router: all run the fused experts); one
    # sequence, so one attention call per layer and step (its rows fit one query block)
    assert len(attention_calls) == len(moe_calls) == 8 * 5
    del attention_calls[:], moe_calls[:]
    both = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in both] == expected
    assert [o.num_cached_tokens for o in both] == [16, 16]
    # both sequences in every step (the rest of each prompt, then 5 decodes): attention once per
    # sequence and layer, the experts once per layer for the whole batch
    assert len(attention_calls) == 2 * len(moe_calls) == 2 * 6 * 5
