"""Reasoning models: free text up to `</think>`, then the constrained answer."""

from __future__ import annotations

import json

import numpy as np

from deepinfer.structured.spec import GrammarSpec
from tests.structured.schemas import SUITE
from tests.structured.validation import strict_validator
from tests.structured.walk import allowed_tokens, random_walk


def test_thinking_is_free_and_the_answer_constrained(backend, hf_tokenizer, tokenizer_info):
    schema = SUITE["enum_in_object"]
    matcher = backend.compile(GrammarSpec.json(schema).with_reasoning()).new_matcher()
    thinking = 'Not JSON at all: {"status": 5, </thin k>, < /think> and "quotes"\n\n'
    for token in hf_tokenizer.encode(thinking, add_special_tokens=False):
        assert matcher.accept_token(token), matcher.error
    bitmask = np.zeros((1, tokenizer_info.bitmask_words), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_tokens(bitmask, 0, tokenizer_info.vocab_size)
    assert hf_tokenizer.eos_token_id not in allowed  # no answer yet
    assert allowed.size > 40000  # free text: almost the whole vocabulary
    answer = '</think>\n\n{"status": "open", "priority": 2}'
    for token in hf_tokenizer.encode(answer, add_special_tokens=False):
        assert matcher.accept_token(token), matcher.error
    assert matcher.is_terminated()
    bad = backend.compile(GrammarSpec.json(schema).with_reasoning()).new_matcher()
    ids = hf_tokenizer.encode('ok</think>{"status": "unknown"', add_special_tokens=False)
    assert bad.validate_tokens(ids) < len(ids)


def test_random_walks_after_thinking(backend, hf_tokenizer, tokenizer_info):
    schema = SUITE["nested_objects"]
    grammar = backend.compile(GrammarSpec.json(schema).with_reasoning("</think>"))
    validator = strict_validator(schema)
    rng = np.random.default_rng(11)
    for _ in range(4):
        walk = random_walk(
            grammar.new_matcher(),
            hf_tokenizer,
            tokenizer_info.vocab_size,
            tokenizer_info.eos_token_ids,
            rng,
            closers=("</think>", '"', "}", "]"),
        )
        text = hf_tokenizer.decode(walk.token_ids)
        _, marker, answer = text.partition("</think>")
        assert marker, text
        errors = [e.message for e in validator.iter_errors(json.loads(answer))]
        assert not errors, f"{answer!r}: {errors}"


def test_special_token_marker(backend, hf_tokenizer, tokenizer_info):
    """When the end marker is a special token (as in some reasoning models), the grammar waits
    for that token id; text that merely resembles it stays thinking."""
    marker = "<file_sep>"
    assert marker in tokenizer_info.special_tokens
    matcher = backend.compile(GrammarSpec.regex("[a-z]{3}").with_reasoning(marker)).new_matcher()
    for token in hf_tokenizer.encode("thinking <file_sep as text", add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(hf_tokenizer.convert_tokens_to_ids(marker))
    for token in hf_tokenizer.encode("abc", add_special_tokens=False):
        assert matcher.accept_token(token), matcher.error
    assert matcher.is_terminated()
