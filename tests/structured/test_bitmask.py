"""Packed-bitmask application against a naive per-token reference."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from deepinfer.structured.bitmask import allocate_bitmask, apply_bitmask_, unpack_bitmask
from deepinfer.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceOptions
from deepinfer.structured.spec import GrammarSpec


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for k, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < words and (int(bitmask[k, word]) >> (token % 32)) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


def random_bitmask(rng: np.random.Generator, rows: int, vocab: int, density: float) -> torch.Tensor:
    bits = rng.random((rows, ((vocab + 31) // 32) * 32)) < density
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    return torch.from_numpy(packed.copy())


@pytest.mark.parametrize(
    ("batch", "logit_vocab", "mask_vocab", "rows"),
    [
        (4, 100, 100, None),  # every row constrained
        (6, 77, 77, [0, 3, 5]),  # a few rows, vocab not a multiple of 32
        (3, 130, 100, [1]),  # model vocab wider than the tokenizer's: tail is -inf
        (2, 90, 128, [0, 1]),  # bitmask wider than the logits: cut
        (5, 64, 64, [4, 0]),  # rows out of order
    ],
)
def test_matches_reference(batch, logit_vocab, mask_vocab, rows):
    rng = np.random.default_rng(batch * 1000 + logit_vocab)
    logits = torch.from_numpy(rng.standard_normal((batch, logit_vocab)).astype(np.float32))
    n = batch if rows is None else len(rows)
    bitmask = random_bitmask(rng, n, mask_vocab, density=0.4)
    expected = reference_apply(logits, bitmask, list(range(batch)) if rows is None else rows)
    out = apply_bitmask_(logits, bitmask, rows)
    assert out is logits
    assert torch.equal(logits, expected)
    untouched = set(range(batch)) - set(range(batch) if rows is None else rows)
    for row in untouched:
        assert torch.isfinite(logits[row]).all()


def test_bfloat16_and_all_allowed():
    logits = torch.randn(2, 96, dtype=torch.bfloat16)
    before = logits.clone()
    apply_bitmask_(logits, allocate_bitmask(2, 96, pin_memory=False))
    assert torch.equal(logits, before)
    # Two words cover 64 tokens; a wider vocabulary's extra tokens are disallowed.
    assert (
        unpack_bitmask(allocate_bitmask(1, 40, pin_memory=False), 70)[0].tolist() == [True] * 64 + [False] * 6
    )


def test_shape_errors():
    logits = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="pass rows"):
        apply_bitmask_(logits, allocate_bitmask(2, 64, pin_memory=False))
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask_(logits, torch.zeros(3, 2, dtype=torch.int64))


def test_real_grammar_mask_guides_argmax(backend, hf_tokenizer, tokenizer_info):
    """Masked greedy decoding of random logits with the real matcher always stays in the grammar."""
    grammar = backend.compile(
        GrammarSpec.json({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    )
    matcher = grammar.new_matcher()
    bitmask = allocate_bitmask(1, tokenizer_info.vocab_size, pin_memory=False)
    generator = torch.Generator().manual_seed(0)
    tokens = []
    for _ in range(60):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, tokenizer_info.vocab_size + 64, generator=generator)  # padded model vocab
        apply_bitmask_(logits, bitmask)
        token = int(logits.argmax())
        assert token < tokenizer_info.vocab_size
        assert matcher.accept_token(token), matcher.error
        if token in tokenizer_info.eos_token_ids:
            break
        tokens.append(token)
    assert matcher.is_terminated()
    assert set(json.loads(hf_tokenizer.decode(tokens))) == {"n"}


def test_per_step_cost_16x49152(capsys):
    """The runner's cost per step for a batch of 16 x 49,152 (printed for the report)."""
    batch, vocab = 16, 49152
    rng = np.random.default_rng(0)
    logits = torch.randn(batch, vocab)
    bitmask = random_bitmask(rng, batch, vocab, density=0.5)
    half = random_bitmask(rng, batch // 2, vocab, density=0.5)
    half_rows = list(range(0, batch, 2))
    for _ in range(5):
        apply_bitmask_(logits, bitmask)
    timings = {}
    # One intra-op thread: on the shared two-core machine, threads fighting over cores make a
    # sub-millisecond op take tens of milliseconds, which measures the neighbours, not this code.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for label, mask, rows in (("all 16 rows", bitmask, None), ("8 of 16 rows", half, half_rows)):
            runs = 50
            start = time.perf_counter()
            for _ in range(runs):
                apply_bitmask_(logits, mask, rows)
            timings[label] = (time.perf_counter() - start) / runs * 1e3
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print(
            f"\napply_bitmask_ 16x{vocab} on CPU: "
            + ", ".join(f"{k}: {v:.3f} ms" for k, v in timings.items())
        )
    assert timings["all 16 rows"] < 25.0  # generous: two shared cores


def test_batched_fill_matches_single_fill(backend, hf_tokenizer, tokenizer_info):
    """backend.fill_bitmasks (parallel, one call per step) writes what per-matcher fills write."""
    grammars = [
        backend.compile(GrammarSpec.json({"type": "object", "properties": {"a": {"type": "string"}}})),
        backend.compile(GrammarSpec.regex("[0-9]+x")),
        backend.compile(GrammarSpec.choice(["alpha", "beta"])),
    ]
    matchers = [g.new_matcher() for g in grammars]
    for matcher, prefix in zip(matchers, ['{"a": "q', "12", "al"]):
        for token in hf_tokenizer.encode(prefix, add_special_tokens=False):
            assert matcher.accept_token(token)
    batched = allocate_bitmask(5, tokenizer_info.vocab_size, pin_memory=False)
    backend.fill_bitmasks([(matchers[0], 4), (matchers[1], 0), (matchers[2], 2)], batched)
    single = allocate_bitmask(5, tokenizer_info.vocab_size, pin_memory=False)
    for matcher, row in ((matchers[0], 4), (matchers[1], 0), (matchers[2], 2)):
        matcher.fill_bitmask(single, row)
    assert torch.equal(batched, single)
    assert (batched[1] == -1).all() and (batched[3] == -1).all()  # unlisted rows untouched
    with pytest.raises(IndexError):
        backend.fill_bitmasks([(matchers[0], 5)], batched)


def test_inline_fill_matches_the_pool(backend, hf_tokenizer, tokenizer_info):
    """mask_threads=0 (CPU inference) computes on the calling thread what the pool computes."""
    inline = LLGuidanceBackend(tokenizer_info, LLGuidanceOptions(mask_threads=0))
    spec = GrammarSpec.json({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    rows = {}
    for name, owner in (("inline", inline), ("pool", backend)):
        matchers = [owner.compile(spec).new_matcher() for _ in range(2)]
        for token in hf_tokenizer.encode('{"n": 4', add_special_tokens=False):
            assert matchers[1].accept_token(token)
        bitmask = allocate_bitmask(3, tokenizer_info.vocab_size, pin_memory=False)
        owner.fill_bitmasks([(matchers[0], 2), (matchers[1], 0)], bitmask)
        rows[name] = bitmask
        assert (bitmask[1] == -1).all()  # unlisted row untouched
        with pytest.raises(IndexError):
            owner.fill_bitmasks([(matchers[0], 3)], bitmask)
    assert torch.equal(rows["inline"], rows["pool"])
    assert not torch.equal(rows["inline"][0], rows["inline"][2])  # the two states differ
