"""Our DeepSeek-V4, loaded from a checkpoint directory, against transformers' DeepseekV4ForCausalLM.

The tiny model has all three layer types (sliding window 8, CSA at 4 with top-3 of the indexer,
HCA at 8), hash-routed and routed MoE layers, 4 mHC streams and per-head sinks. fp32 logits agree
within 1e-4 for whole prompts and token by token through the incremental state (the windowed
rows released as soon as no step can read them), in chunks, batched, and greedy continuations of
64 tokens equal HF generate's.
"""

from __future__ import annotations

import torch

from tests.deepseek_v4.conftest import CachedRun

ATOL = 1e-4


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.hf(torch.tensor([ids])).logits[0]


def test_whole_prompt_logits_match_hf(tiny, tiny_model):
    vocab = tiny.config["vocab_size"]
    for length, seed in ((5, 1), (23, 2), (61, 3)):
        ids = _prompt(length, seed, vocab)
        run = CachedRun(tiny_model)
        (ours,) = run.logits({run.new_sequence(): ids})
        torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_token_by_token_matches_hf(tiny, tiny_model):
    """50 tokens one at a time: 6 sliding windows, 6 HCA entries, 12 CSA entries of which each
    query attends at most 3."""
    cfg = tiny.config
    ids = _prompt(50, 4, cfg["vocab_size"])
    assert len(ids) >= 3 * cfg["sliding_window"]
    assert len(ids) // cfg["compress_rates"]["heavily_compressed_attention"] >= 2
    assert len(ids) // cfg["compress_rates"]["compressed_sparse_attention"] > cfg["index_topk"]
    run = CachedRun(tiny_model)
    seq = run.new_sequence()
    ours = torch.cat([run.logits({seq: [token]})[0] for token in ids])
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_chunked_and_batched_match_hf(tiny, tiny_model):
    """Two sequences share every step, in chunks of 7 and 3 tokens that start and end inside
    windows and compression windows alike."""
    vocab = tiny.config["vocab_size"]
    a, b = _prompt(44, 5, vocab), _prompt(31, 6, vocab)
    run = CachedRun(tiny_model)
    sa, sb = run.new_sequence(), run.new_sequence()
    got: dict[int, list[torch.Tensor]] = {sa: [], sb: []}
    pa = pb = 0
    while pa < len(a) or pb < len(b):
        chunks = {}
        if pa < len(a):
            chunks[sa] = a[pa : pa + 7]
        if pb < len(b):
            chunks[sb] = b[pb : pb + 3]
        for seq, logits in zip(chunks, run.logits(chunks)):
            got[seq].append(logits)
        pa, pb = pa + 7, pb + 3
    torch.testing.assert_close(torch.cat(got[sa]), _hf_logits(tiny, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got[sb]), _hf_logits(tiny, b), atol=ATOL, rtol=0)


def test_greedy_64_tokens_match_hf_generate(tiny, tiny_model):
    ids = _prompt(20, 7, tiny.config["vocab_size"])
    run = CachedRun(tiny_model)
    seq = run.new_sequence()
    (logits,) = run.logits({seq: ids})
    generated = [int(logits[-1].argmax())]
    while len(generated) < 64:
        (logits,) = run.logits({seq: generated[-1:]})
        generated.append(int(logits[-1].argmax()))
    with torch.no_grad():
        expected = tiny.hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=2)
    assert generated == expected[0, len(ids) :].tolist()
    assert len(set(generated)) > 8  # a real continuation, not one token repeated


def test_queries_in_blocks_match_hf(tiny, tiny_model, monkeypatch):
    """A long prefill attends its queries in blocks (QUERY_BLOCK); blocks of 5 over 61 tokens."""
    import deepinfer.model.deepseek_v4.attention as v4_attention

    monkeypatch.setattr(v4_attention, "QUERY_BLOCK", 5)
    ids = _prompt(61, 17, tiny.config["vocab_size"])
    run = CachedRun(tiny_model)
    (ours,) = run.logits({run.new_sequence(): ids})
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)
