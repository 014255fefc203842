"""The engine around the DeepSeek model: scheduling choices never change greedy outputs.

One weight copy serves engines that differ in batching, prefill chunking (32 tokens), KV budget
(small enough to force preemption) and prefix caching; every one must produce the outputs of
running each prompt alone.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(v3_ckpt) -> list[list[int]]:
    """Token-id prompts: three share a 40-token prefix (2+ full blocks), lengths 12..101."""
    generator = torch.Generator().manual_seed(7)
    vocab = v3_ckpt.config["vocab_size"]

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    shared = ids(40)
    return [shared + ids(5), shared + ids(30), ids(90), shared + ids(61), ids(12)]


@pytest.fixture(scope="module")
def alone(v3_llm, prompts) -> list[list[int]]:
    llm = LLM(loaded=v3_llm.engine.core.loaded, num_blocks=64, enable_prefix_caching=False, num_threads=1)
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def test_batched_equals_one_at_a_time(v3_llm, prompts, alone):
    llm = LLM(loaded=v3_llm.engine.core.loaded, num_blocks=64, enable_prefix_caching=False, num_threads=1)
    assert _run(llm, prompts) == alone


def test_chunked_prefill_equals_one_at_a_time(v3_llm, prompts, alone):
    """32-token chunks: later chunks attend to earlier ones through the latent cache, and chunks
    share steps with decode rows."""
    loaded = v3_llm.engine.core.loaded
    llm = LLM(
        loaded=loaded,
        num_blocks=64,
        prefill_chunk_size=32,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        num_threads=1,
    )
    steps: list[tuple[list[int], list[int]]] = []  # (query_lens, seq_lens) of every forward
    hook = loaded.model.register_forward_pre_hook(
        lambda _, args: steps.append((list(args[3].query_lens), list(args[3].groups[0].seq_lens_list)))
    )
    try:
        assert _run(llm, prompts) == alone
    finally:
        hook.remove()
    rows = [row for query_lens, seq_lens in steps for row in zip(query_lens, seq_lens)]
    assert max(q for q, _ in rows) == 32
    assert any(1 < q < s for q, s in rows)  # a chunk after an earlier chunk of the same prompt
    assert any(1 in q and max(q) > 1 for q, _ in steps)  # decode rows and a chunk in one step


def test_preemption_equals_one_at_a_time(v3_llm, prompts, alone):
    """12 blocks of 16 tokens hold any one sequence (<= 133 tokens) but not all five at once."""
    llm = LLM(
        loaded=v3_llm.engine.core.loaded,
        num_blocks=12,
        prefill_chunk_size=32,
        enable_prefix_caching=False,
        num_threads=1,
    )
    assert _run(llm, prompts) == alone
    assert llm.engine.core.stats().num_preemptions > 0


def test_prefix_caching_equals_one_at_a_time(v3_llm, prompts, alone):
    """Cached latent blocks are reused across requests (and across runs) without changing outputs."""
    llm = LLM(loaded=v3_llm.engine.core.loaded, num_blocks=64, enable_prefix_caching=True, num_threads=1)
    assert _run(llm, prompts) == alone
    assert _run(llm, prompts) == alone
    stats = llm.engine.core.stats()
    assert stats.prefix_hit_tokens >= 3 * 32  # the second run found at least the shared prefixes


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_kv_bytes_per_token_is_the_latent(v3_llm, v3_ckpt, dtype, size):
    """The cache holds kv_lora_rank + qk_rope_head_dim values per token and layer, nothing per head,
    and no MTP layer."""
    cfg = v3_ckpt.config
    llm = (
        v3_llm
        if dtype == "float32"
        else LLM(model=str(v3_ckpt.path), dtype=dtype, num_blocks=8, num_threads=1)
    )
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert llm.engine.core.kv_bytes_per_token == cfg["num_hidden_layers"] * latent * size
    caches = llm.engine.core.runner.kv_caches
    assert len(caches) == cfg["num_hidden_layers"]
    assert caches[0].shape[1:] == (latent,)
