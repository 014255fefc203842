"""The kept state: what each layer type declares, that a decode never reads outside it (the
contiguous store raises on any row it dropped), the byte formula, and rollback."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.model.deepseek_v4.cache import CacheKind, StepLayout, kv_cache_bytes
from tests.deepseek_v4.conftest import CachedRun
from tests.deepseek_v4.oracle_cache import ContiguousV4Cache


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_declarations_per_layer_type(tiny_model):
    by_layer: dict[int, list[tuple[str, int, int, int | None]]] = {}
    for d in tiny_model.cache_declarations():
        by_layer.setdefault(d.layer, []).append((d.kind.value, d.width, d.tokens_per_row, d.lookback))
    window = ("sliding_kv", 32, 1, 7)  # head_dim 32, window 8: a step reads the 7 positions before it
    assert by_layer[0] == [window]  # sliding
    assert by_layer[1] == [  # CSA, m = 4: two windows of [kv | gate] halves, index_head_dim 16
        window,
        ("compressor_state", 128, 1, 7),
        ("compressed_kv", 32, 4, None),
        ("indexer_state", 64, 1, 7),
        ("indexer_keys", 16, 4, None),
    ]
    assert by_layer[2] == [
        window,
        ("compressor_state", 64, 1, 7),
        ("compressed_kv", 32, 8, None),
    ]  # HCA, m = 8
    assert by_layer[5] == [window]  # the MTP module's block


def test_held_bytes_equal_the_formula(tiny, tiny_model):
    """Decoding with every row outside the declared lookbacks dropped after each step (reading
    one would raise) holds exactly what kv_cache_bytes computes from the declarations."""
    decls = tiny_model.cache_declarations()
    main = [d for d in decls if d.layer < tiny_model.arch.num_layers]
    ids = _prompt(41, 12, tiny.config["vocab_size"])
    run = CachedRun(tiny_model)
    seq = run.new_sequence()
    for length, token in enumerate(ids, start=1):
        run.step({seq: [token]})
        if length in (1, 3, 8, 9, 16, 23, 41):
            assert run.cache.bytes_in_use(seq) == sum(kv_cache_bytes(main, length, 4).values()), length
    held = kv_cache_bytes(main, 41, 4)
    assert held[CacheKind.COMPRESSED_KV] == 4 * 32 * (2 * (41 // 4) + 2 * (41 // 8))


def test_reads_outside_the_declaration_raise(tiny_model):
    cache = ContiguousV4Cache(tiny_model.cache_declarations(), torch.float32, torch.device("cpu"))
    seq = cache.add_sequence()
    write = cache.step([seq], StepLayout((0,), (20,)))
    write.write(0, 0, CacheKind.SLIDING_KV, torch.arange(20), torch.zeros(20, 32))
    step = cache.step([seq], StepLayout((20,), (1,)))
    step.read(0, 0, CacheKind.SLIDING_KV, torch.arange(13, 20))  # the 7 positions before 20
    with pytest.raises(RuntimeError, match="lookback 7"):
        step.read(0, 0, CacheKind.SLIDING_KV, torch.arange(12, 20))
    with pytest.raises(RuntimeError, match="rows < 21"):
        step.read(0, 0, CacheKind.SLIDING_KV, torch.tensor([21]))
    with pytest.raises(RuntimeError, match="not held"):
        step.read(0, 0, CacheKind.SLIDING_KV, torch.tensor([20]))
    with pytest.raises(KeyError, match="layer 0 declares no compressed_kv"):
        step.read(0, 0, CacheKind.COMPRESSED_KV, torch.tensor([0]))


def test_rollback_rewrites_rather_than_undoes(tiny, tiny_model):
    """Decode 10 draft tokens past 27, roll back to 30 and continue differently: every logit equals
    a fresh run of the final sequence (compressed entries closed by rejected tokens are rebuilt)."""
    vocab = tiny.config["vocab_size"]
    prefix, drafts, accepted = _prompt(27, 13, vocab), _prompt(10, 14, vocab), _prompt(9, 15, vocab)
    run = CachedRun(tiny_model, release=False)
    seq = run.new_sequence()
    run.step({seq: prefix})
    run.step({seq: drafts})
    run.cache.truncate(seq, 30)
    run.lengths[seq] = 30
    (ours,) = run.logits({seq: accepted})
    fresh = CachedRun(tiny_model)
    (expected,) = fresh.logits({fresh.new_sequence(): prefix + drafts[:3] + accepted})
    torch.testing.assert_close(ours, expected[30:], atol=1e-4, rtol=0)


def test_indexer_ties_do_not_depend_on_chunking(tiny, tiny_model):
    """With 2 of the 16 indexer heads left, many scores are exactly 0 (ReLU) and tie: the picks go
    to the older entries however the step is cut, so token-by-token equals the whole prompt."""
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for layer in model.layers:
            indexer = layer.attn.indexer
            if indexer is not None:
                indexer.wq_b[2 * indexer.head_dim :] = 0
    ids = _prompt(60, 16, tiny.config["vocab_size"])
    whole = CachedRun(model)
    (expected,) = whole.logits({whole.new_sequence(): ids})
    run = CachedRun(model)
    seq = run.new_sequence()
    ours = torch.cat([run.logits({seq: ids[p : p + 5]})[0] for p in range(0, len(ids), 5)])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_layout_from_engine_lengths_and_position_check(tiny_model):
    layout = StepLayout.from_lengths(query_lens=[1, 5], context_lens=[40, 5])
    assert layout.starts == (39, 0) and layout.offsets == [0, 1, 6]
    cache = ContiguousV4Cache(tiny_model.cache_declarations(), torch.float32, torch.device("cpu"))
    seqs = [cache.add_sequence(), cache.add_sequence()]
    with pytest.raises(ValueError, match="positions must run consecutively"):
        tiny_model.forward_cached(
            torch.zeros(6, dtype=torch.long), torch.arange(6), layout, cache.step(seqs, layout)
        )
