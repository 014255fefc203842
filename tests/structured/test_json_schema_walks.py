"""Every schema of the suite, driven by random walks over the real SmolLM2 tokenizer's masks.

Each walk's decoded text must be JSON that validates (formats included); after the grammar ends
only EOS is allowed (checked inside the walk).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from deepinfer.structured.llguidance_backend import LLGuidanceGrammar
from deepinfer.structured.spec import GrammarSpec
from tests.structured.schemas import SUITE
from tests.structured.validation import strict_validator
from tests.structured.walk import allowed_tokens, random_walk

SAMPLES_PER_SCHEMA = 5


def test_suite_is_large_enough():
    assert len(SUITE) >= 40


@pytest.mark.parametrize("name", sorted(SUITE))
def test_random_walks_validate(name, backend, hf_tokenizer, tokenizer_info):
    schema = SUITE[name]
    grammar = backend.compile(GrammarSpec.json(schema))
    assert isinstance(grammar, LLGuidanceGrammar), grammar
    validator = strict_validator(schema)
    rng = np.random.default_rng(sum(map(ord, name)))  # fixed seed per schema
    for _ in range(SAMPLES_PER_SCHEMA):
        walk = random_walk(
            grammar.new_matcher(), hf_tokenizer, tokenizer_info.vocab_size, tokenizer_info.eos_token_ids, rng
        )
        assert walk.ended_with_eos
        text = hf_tokenizer.decode(walk.token_ids)
        value = json.loads(text)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, f"{name}: {text!r} violates the schema: {errors}"


def test_whitespace_is_bounded(backend, hf_tokenizer, tokenizer_info):
    """A model that wants to emit spaces forever is stopped after a short run."""
    matcher = backend.compile(GrammarSpec.json({"type": "object"})).new_matcher()
    assert matcher.accept_token(hf_tokenizer.encode("{", add_special_tokens=False)[0])
    space = hf_tokenizer.encode(" ", add_special_tokens=False)
    newline = hf_tokenizer.encode("\n", add_special_tokens=False)
    assert matcher.validate_tokens(space * 100) == 2
    assert matcher.validate_tokens(newline + space * 100) == 33
    assert matcher.validate_tokens(newline * 3) == 1
    # Pretty-printed JSON is still fine.
    pretty = json.dumps({"a": [1, {"b": None}], "c": "d"}, indent=2)
    matcher.reset()
    assert all(matcher.accept_token(t) for t in hf_tokenizer.encode(pretty, add_special_tokens=False))
    assert matcher.is_terminated()


def test_only_eos_after_termination(backend, hf_tokenizer, tokenizer_info):
    matcher = backend.compile(GrammarSpec.json(SUITE["flat_required"])).new_matcher()
    for token in hf_tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False):
        assert matcher.accept_token(token), matcher.error
    assert matcher.is_terminated()
    bitmask = np.zeros((1, tokenizer_info.bitmask_words), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_tokens(bitmask, 0, tokenizer_info.vocab_size).tolist() == list(
        tokenizer_info.eos_token_ids
    )
    assert not matcher.accept_token(hf_tokenizer.encode(" ", add_special_tokens=False)[0])
    assert matcher.error


def test_rollback_and_reset(backend, hf_tokenizer):
    matcher = backend.compile(GrammarSpec.json(SUITE["flat_required"])).new_matcher()
    good = hf_tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    for token in good[:-2]:
        assert matcher.accept_token(token)
    matcher.rollback(3)
    for token in good[-5:]:
        assert matcher.accept_token(token), matcher.error
    assert matcher.is_terminated()
    assert not matcher.accept_token(good[0])  # error state
    matcher.reset()  # leaves the error state
    assert matcher.error is None
    assert matcher.validate_tokens(good) == len(good)


def test_choice_and_regex(backend, hf_tokenizer, tokenizer_info):
    rng = np.random.default_rng(7)
    choices = ["yes", "no", "not sure"]
    grammar = backend.compile(GrammarSpec.choice(choices))
    seen = set()
    for _ in range(12):
        walk = random_walk(
            grammar.new_matcher(), hf_tokenizer, tokenizer_info.vocab_size, tokenizer_info.eos_token_ids, rng
        )
        seen.add(hf_tokenizer.decode(walk.token_ids))
    assert seen <= set(choices) and len(seen) >= 2
    pattern = r"[A-Z][a-z]{1,5}-[0-9]{2,3}"
    grammar = backend.compile(GrammarSpec.regex(pattern))
    for _ in range(5):
        walk = random_walk(
            grammar.new_matcher(), hf_tokenizer, tokenizer_info.vocab_size, tokenizer_info.eos_token_ids, rng
        )
        assert re.fullmatch(pattern, hf_tokenizer.decode(walk.token_ids))


def test_lark_and_gbnf_grammars(backend, hf_tokenizer, tokenizer_info):
    rng = np.random.default_rng(3)
    lark = 'start: "SELECT " COLUMN (", " COLUMN)* " FROM " TABLE ";"\nCOLUMN: /[a-z]{1,8}/\nTABLE: /[A-Z][a-z]{1,8}/\n'
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]{0,2}'
    for text, shape in (
        (lark, r"SELECT [a-z]{1,8}(, [a-z]{1,8})* FROM [A-Z][a-z]{1,8};"),
        (gbnf, r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2})*\)"),
    ):
        grammar = backend.compile(GrammarSpec.grammar(text))
        assert isinstance(grammar, LLGuidanceGrammar), grammar
        for _ in range(4):
            walk = random_walk(
                grammar.new_matcher(),
                hf_tokenizer,
                tokenizer_info.vocab_size,
                tokenizer_info.eos_token_ids,
                rng,
                closers=(";", ")"),
            )
            assert re.fullmatch(shape, hf_tokenizer.decode(walk.token_ids))
