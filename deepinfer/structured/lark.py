"""Small helpers for writing llguidance's Lark dialect from Python."""

from __future__ import annotations

import json
import re
from collections.abc import Collection

# Characters with a meaning in Rust `regex` syntax, plus the `/` that delimits Lark regexes.
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~/])")


def lark_string(text: str) -> str:
    """A Lark string literal matching `text` byte for byte (Lark accepts JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def lark_literal(text: str, special_tokens: Collection[str] = ()) -> str:
    """A Lark sequence matching `text`, where substrings that are special tokens of the tokenizer
    are referenced as tokens (`<|im_end|>`): a special token never matches as plain text."""
    if not text:
        raise ValueError("a Lark literal must not be empty")
    specials = sorted(
        (s for s in special_tokens if s.startswith("<") and s.endswith(">") and s in text), key=len
    )
    if not specials:
        return lark_string(text)
    pattern = re.compile("|".join(re.escape(s) for s in reversed(specials)))  # longest first
    parts: list[str] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            parts.append(lark_string(text[pos : m.start()]))
        parts.append(m.group(0))
        pos = m.end()
    if pos < len(text):
        parts.append(lark_string(text[pos:]))
    return " ".join(parts)


def regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark `/.../` regex."""
    return _REGEX_META.sub(r"\\\1", text)


def rule_name(prefix: str, index: int, hint: str = "") -> str:
    """A valid, unique Lark rule name; `hint` (e.g. a tool name) only makes grammars readable."""
    cleaned = re.sub(r"[^a-z0-9_]", "_", hint.lower())[:40]
    return f"{prefix}{index}_{cleaned}" if cleaned else f"{prefix}{index}"
