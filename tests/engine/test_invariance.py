"""Greedy outputs must not depend on batching, chunking, preemption or prefix caching."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

TOPICS = ["dragons", "the ocean", "a robot", "tea", "mountains", "the moon", "bread", "trains"]
# 16 prompts of varied length; pairs share a long prefix so prefix caching has something to hit.
PROMPTS = [
    f"<|im_start|>system\nYou are a concise assistant who answers in plain English.<|im_end|>\n"
    f"<|im_start|>user\nWrite {'two sentences' if i % 2 else 'a short poem'} about {TOPICS[i % 8]}."
    f"{' Mention a color.' * (i % 3)}<|im_end|>\n<|im_start|>assistant\n"
    for i in range(16)
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(default_llm):
    """All 16 prompts in one batch on the default engine."""
    return [o.outputs[0].token_ids for o in default_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def engine(default_llm, **options) -> LLM:
    return LLM(loaded=default_llm.engine.core.loaded, **options)


def test_one_at_a_time_equals_batched(default_llm, reference):
    alone = [default_llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == reference


def test_prefill_chunks_of_32_tokens(default_llm, reference):
    llm = engine(default_llm, prefill_chunk_size=32, max_num_batched_tokens=64, num_blocks=512)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_preemption_under_a_small_kv_budget(default_llm, reference):
    # 16 sequences of ~80 tokens need ~96 blocks of 16; 40 blocks forces repeated preemption.
    llm = engine(default_llm, num_blocks=40, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.engine.core.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.engine.core.kv.num_used_blocks == 0


def test_prefix_caching_off_and_on_with_preemption(default_llm, reference):
    off = engine(default_llm, num_blocks=512, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in off.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference
    on = engine(default_llm, num_blocks=40, enable_prefix_caching=True)
    on.generate(PROMPTS[:4], PARAMS, use_tqdm=False)  # warm the cache with shared prefixes
    outputs = on.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert on.engine.core.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert on.engine.core.kv.num_used_blocks == 0
