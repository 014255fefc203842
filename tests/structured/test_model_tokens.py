"""Markers that are tokens of the model's own vocabulary (Qwen's `<tool_call>`, DeepSeek's and
Qwen's `</think>`): added tokens without the `special` flag, which llguidance nevertheless keeps
apart from text. A grammar must accept the model's own marker token, and forced tool calls and
reasoning models must combine."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer

from deepinfer.recipe.ir import Tool
from deepinfer.structured.llguidance_backend import LLGuidanceBackend
from deepinfer.structured.spec import GrammarSpec
from deepinfer.structured.tokenizer_info import TokenizerInfo
from deepinfer.structured.tool_calls import tool_call_spec

PING = Tool(
    "ping",
    parameters={
        "type": "object",
        "properties": {"host": {"type": "string", "enum": ["a.example", "b.example"]}},
        "required": ["host"],
        "additionalProperties": False,
    },
)
CALL_BODY = '\n{"name": "ping", "arguments": {"host": "a.example"}}\n'


@pytest.fixture(scope="module")
def qwen_like(hf_tokenizer):
    """SmolLM2's tokenizer plus Qwen-style marker tokens, added the way Qwen's tokenizer has them."""
    tokenizer = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    markers = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    info = TokenizerInfo.from_backend_tokenizer(tokenizer, [hf_tokenizer.eos_token_id])
    return tokenizer, LLGuidanceBackend(info)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_unflagged_marker_tokens_count_as_special(qwen_like):
    tokenizer, backend = qwen_like
    special = backend.tokenizer_info.special_tokens
    assert {"<tool_call>", "</tool_call>", "</think>"} <= special
    assert "<|im_end|>" in special  # flagged special in the tokenizer itself
    assert len(_ids(tokenizer, "<tool_call>")) == 1  # one token in the vocabulary


def test_forced_call_uses_the_models_marker_tokens(qwen_like, hf_tokenizer):
    tokenizer, backend = qwen_like
    spec = tool_call_spec([PING], "hermes", special_tokens=backend.tokenizer_info.special_tokens)
    matcher = backend.compile(spec).new_matcher()
    for token in _ids(tokenizer, "<tool_call>" + CALL_BODY + "</tool_call>"):
        assert matcher.accept_token(token), matcher.error
    assert matcher.accept_token(hf_tokenizer.eos_token_id)
    # The marker spelled as text instead of the model's token is not the marker.
    spelled = backend.compile(spec).new_matcher()
    assert spelled.validate_tokens(_ids(hf_tokenizer.backend_tokenizer, "<tool_call>")) == 0


@pytest.mark.parametrize(
    ("build", "answer"),
    [
        (
            lambda special: tool_call_spec(
                [PING], "hermes", special_tokens=special, after_reasoning="</think>"
            ),
            "<tool_call>" + CALL_BODY + "</tool_call>",
        ),
        (lambda special: GrammarSpec.choice(["yes", "no"]).with_reasoning(), "no"),
        (lambda special: GrammarSpec.grammar('start: "ok" | "fine"\n').with_reasoning(), "fine"),
        (lambda special: GrammarSpec.json({"type": "integer"}).with_reasoning(), "42"),
    ],
    ids=["tool_call", "choice", "lark", "json"],
)
def test_reasoning_then_constraint_with_the_end_token(qwen_like, hf_tokenizer, build, answer):
    """Lark-based constraints (forced tool calls, choices, grammars) combine with a thinking
    section too, and the model's own `</think>` token ends it."""
    tokenizer, backend = qwen_like
    matcher = backend.compile(build(backend.tokenizer_info.special_tokens)).new_matcher()
    thinking = 'Let me think: "quotes", {not json} and </thin k> are all fine here.\n'
    for token in _ids(tokenizer, thinking):
        assert matcher.accept_token(token), matcher.error
    end = _ids(tokenizer, "</think>")
    assert len(end) == 1
    for token in end + _ids(tokenizer, "\n\n" + answer):
        assert matcher.accept_token(token), (answer, matcher.error)
    assert matcher.accept_token(hf_tokenizer.eos_token_id), matcher.error
    assert matcher.is_terminated()
