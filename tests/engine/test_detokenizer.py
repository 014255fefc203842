"""Incremental detokenization never emits a broken UTF-8 character and equals the full decode."""

from __future__ import annotations

from deepinfer.frontend.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello 😀 world 🐉🐉!", "日本語のテキスト、中文字符 and émoji 👩‍👩‍👧", "  leading spaces\n\ttabs  "]


def test_streamed_text_equals_full_decode_without_replacement_chars(default_llm):
    tokenizer = default_llm.get_tokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids) or text == TEXTS[2]
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Say:"))
        pieces = [detok.add([t]) for t in ids]
        pieces.append(detok.flush())
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tokenizer.decode(ids)
