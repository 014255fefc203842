"""Automatic prefix caching on the real model: hits, isolation by cache salt, stable hashes."""

from __future__ import annotations

import subprocess
import sys

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache.prefix import block_hash, namespace_root

SYSTEM = "<|im_start|>system\n" + "You are a careful assistant. Follow the rules. " * 20 + "<|im_end|>\n"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def fresh(default_llm, **options) -> LLM:
    return LLM(loaded=default_llm.engine.core.loaded, num_blocks=256, **options)


def test_shared_prefix_hits_and_output_is_unchanged(default_llm):
    llm = fresh(default_llm)
    first = llm.generate(SYSTEM + "<|im_start|>user\nHi<|im_end|>\n", GREEDY, use_tqdm=False)[0]
    second = llm.generate(SYSTEM + "<|im_start|>user\nHello there<|im_end|>\n", GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    shared = next(
        i for i, (a, b) in enumerate(zip(first.prompt_token_ids, second.prompt_token_ids)) if a != b
    )
    assert second.num_cached_tokens == shared // 16 * 16  # every full block of the common prefix
    cold = fresh(default_llm, enable_prefix_caching=False)
    expected = cold.generate(SYSTEM + "<|im_start|>user\nHello there<|im_end|>\n", GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    stats = llm.engine.core.stats()
    assert stats.prefix_lookups == 2 and stats.prefix_hit_tokens == second.num_cached_tokens
    assert 0 < stats.prefix_hit_rate < 1


def test_next_turn_hits_the_previous_answer(default_llm):
    llm = fresh(default_llm)
    turn1 = SYSTEM + "<|im_start|>user\nCount to twenty.<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate(
        turn1, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False
    )[0]
    turn2_ids = out.prompt_token_ids + out.outputs[0].token_ids + llm.get_tokenizer().encode("<|im_end|>\n")
    again = llm.generate([turn2_ids], GREEDY, use_tqdm=False)[0]
    # Blocks filled during decode are cached too: the hit reaches into the previous answer.
    assert again.num_cached_tokens > len(out.prompt_token_ids)


def test_cache_salt_isolates_tenants(default_llm):
    llm = fresh(default_llm)
    prompt = SYSTEM + "<|im_start|>user\nSecret plans<|im_end|>\n"
    llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt="tenant-a")
    other = llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt="tenant-b")[0]
    unsalted = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    same = llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens > 0


def test_disabled_and_reset(default_llm):
    off = fresh(default_llm, enable_prefix_caching=False)
    off.generate(SYSTEM, GREEDY, use_tqdm=False)
    assert off.generate(SYSTEM, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    on = fresh(default_llm)
    on.generate(SYSTEM, GREEDY, use_tqdm=False)
    assert on.reset_prefix_cache()
    assert on.generate(SYSTEM, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_n_choices_and_preemption_rehit_own_blocks(default_llm):
    llm = LLM(loaded=default_llm.engine.core.loaded, num_blocks=24)
    prompts = [SYSTEM + f"<|im_start|>user\nQuestion {i}<|im_end|>\n" for i in range(4)]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    assert llm.engine.core.num_preemptions > 0
    assert llm.engine.core.stats().prefix_hit_tokens > 0
    cold = fresh(default_llm, enable_prefix_caching=False)
    expected = cold.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.core.kv.num_used_blocks == 0


def test_hashes_identical_across_processes():
    code = (
        "from deepinfer.engine.kv_cache.prefix import block_hash, namespace_root;"
        "print(block_hash(namespace_root('model-x', 'salt'), list(range(16))).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == block_hash(namespace_root("model-x", "salt"), list(range(16))).hex()
