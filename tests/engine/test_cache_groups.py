"""Cache groups: a model with a full-attention group and a sliding-window group (a tiny random
Qwen2 with alternating layer types, the format HF transformers reads), against HF and through the
engine's chunked prefill, preemption and prefix caching; and the torch-free sliding-window
manager alone, with exact block ids."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from deepinfer import LLM, SamplingParams
from deepinfer.cache_layout import CacheGroup, CacheTensor, plan_cache_layout
from deepinfer.engine.kv_cache.groups import NULL_BLOCK
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.model.loader.source import converted_gguf_dir

from .helpers import kv_manager, sequence
from .test_parity_tiny import COMMON, make_checkpoint

WINDOW = 8
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_path):
    directory = tmp_path_factory.mktemp("qwen2-sliding")
    config = Qwen2Config(
        **COMMON,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )
    hf = make_checkpoint("qwen2-sliding", directory, converted_gguf_dir(default_model_path), config)
    hf.generation_config.eos_token_id = None
    return directory, hf


def _prompts(count: int, base: int = 40) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 48000 + 200 for j in range(base + 7 * i)] for i in range(count)]


def _llm(directory, **options) -> LLM:
    return LLM(model=str(directory), block_size=BLOCK, num_threads=1, **options)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_the_model_declares_a_full_and_a_sliding_group(checkpoint):
    llm = _llm(checkpoint[0], num_blocks=64)
    groups = [g.group for g in llm.engine.core.layout.groups]
    assert [(g.kind, g.window, len(g.tensors)) for g in groups] == [("full", None, 1), ("sliding", WINDOW, 2)]


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_logits_and_greedy_match_hf(checkpoint, backend):
    directory, hf = checkpoint
    llm = _llm(directory, num_blocks=96, attention_backend=backend)
    prompts = _prompts(2)
    for prompt in prompts:  # prompts of 5-6 windows
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(llm.engine.core.score(prompt), expected, atol=1e-4, rtol=0)
    for prompt, ours in zip(prompts, _greedy(llm, prompts, 32)):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert ours == theirs[0, len(prompt) :].tolist()


def test_chunked_preempted_and_batched_equal_one_at_a_time(checkpoint):
    directory, _ = checkpoint
    prompts = _prompts(8)
    alone_llm = _llm(directory, num_blocks=128, enable_prefix_caching=False)
    alone = [_greedy(alone_llm, [p])[0] for p in prompts]
    # Small chunks and a budget that forces preemption while all eight run.
    llm = _llm(directory, num_blocks=40, prefill_chunk_size=7, max_num_batched_tokens=32)
    assert _greedy(llm, prompts) == alone
    assert llm.engine.core.num_preemptions > 0
    assert llm.engine.core.kv.num_used_blocks == 0


def test_prefix_hits_restore_the_window(checkpoint):
    directory, _ = checkpoint
    shared = _prompts(1, 45)[0]
    prompts = [shared + [300 + i] * (3 + i) for i in range(4)]
    cold = _greedy(_llm(directory, num_blocks=128, enable_prefix_caching=False), prompts)
    llm = _llm(directory, num_blocks=128)
    first = llm.generate(
        [{"prompt_token_ids": prompts[0]}],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    later = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[1:]],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in first + later] == cold
    # The shared 45 tokens hold 11 full blocks; a hit ends on a block boundary of both groups.
    assert all(o.num_cached_tokens == 44 for o in later)
    assert llm.engine.core.kv.num_used_blocks == 0


def test_a_long_sequence_holds_only_its_window_of_sliding_blocks(checkpoint):
    directory, _ = checkpoint
    llm = _llm(directory, num_blocks=128)
    engine = llm.engine
    engine.add_request(
        _prompts(1, 20)[0], SamplingParams(temperature=0.0, max_tokens=20 * WINDOW, ignore_eos=True)
    )
    sliding = engine.core.kv.groups[1]
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.core.scheduler.running:
            if seq.num_output_tokens >= 2:  # decoding (the prompt's chunk took its blocks at once)
                most = max(most, sum(1 for b in seq.block_tables[1] if b != NULL_BLOCK))
    # A query sees WINDOW positions, which span at most ceil((WINDOW - 1) / BLOCK) + 1 blocks.
    assert most == -(-(WINDOW - 1) // BLOCK) + 1
    assert sliding.pool.num_free == sliding.pool.num_blocks


# -- the sliding-window manager alone -------------------------------------------------------------


def _admit(kv: KVCacheManager, seq) -> None:
    hit = kv.find_cached_prefix(seq)
    kv.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)


def test_blocks_leave_the_window_as_the_sequence_grows():
    kv = kv_manager(num_blocks=8, block_size=4, window=6)
    seq = sequence(list(range(10)))  # positions 0..9 in blocks 0, 1, 2
    _admit(kv, seq)
    assert seq.block_tables == [[0, 1, 2]]
    # The next query (position 10) sees positions 5..10: block 0 (0..3) is released.
    seq.token_ids.append(99)
    kv.allocate(seq, 1)
    assert seq.block_tables == [[NULL_BLOCK, 1, 2]]
    assert kv.groups[0].pool.blocks[0].ref_count == 0 and kv.groups[0].pool.num_cached == 2
    kv.free(seq)
    assert kv.num_used_blocks == 0


def test_a_hit_needs_only_the_window_in_front_of_it():
    kv = kv_manager(num_blocks=8, block_size=4, window=6)
    a = sequence(list(range(17)), 0)
    _admit(kv, a)  # blocks 0..3 full and cached, block 4 partial
    kv.free(a)
    kv.groups[0].pool.reset_prefix_cache()  # forget everything, then cache blocks 2 and 3 alone
    b = sequence(list(range(17)), 1)
    kv.update_hashes(b)
    for block, index in ((2, 2), (3, 3)):
        kv.groups[0].pool.register(block, b.block_hashes[index])
    hit = kv.find_cached_prefix(b)
    # A hit of 16 tokens: the query at 16 sees 11..16, i.e. blocks 2 and 3; blocks 0, 1 are not needed.
    assert hit.num_tokens == 16 and hit.blocks == [[NULL_BLOCK, NULL_BLOCK, 2, 3]]


def test_groups_share_admission_and_preemption_decisions():
    tensor = CacheTensor("t", (2, 1, 4), "float32", 4)
    full = CacheGroup("full", (tensor,))
    sliding = CacheGroup("sliding", (tensor,), window=4)
    layout = plan_cache_layout([full, sliding], 4, num_blocks=6, max_num_seqs=1, max_num_batched_tokens=8)
    kv = KVCacheManager(layout)
    # The sliding pool is bounded by one sequence's window: 1 * (ceil(3 / 4) + 2) + ceil(8 / 4) = 5.
    assert [g.pool.num_blocks for g in kv.groups] == [6, 5]
    seq = sequence(list(range(22)))
    assert not kv.can_allocate(seq, 22)  # 6 full blocks fit, but 6 sliding blocks do not
    assert kv.can_allocate(seq, 20)
    kv.allocate(seq, 20)
    assert [len(t) for t in seq.block_tables] == [5, 5]
