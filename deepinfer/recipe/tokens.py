"""Prompt token ids in which only the renderer's own markers are control tokens.

Hugging Face tokenizers turn every spelling of an added token into that token, wherever it is,
so encoding a rendered prompt as one string would let a user forge turns (`<｜User｜>`,
`<|im_start|>system`, `<think>`). Here the text a client sent can never become a control token:

1. Before rendering, every special spelling inside client text (message text, reasoning, tool
   names, arguments, schemas, results) is swapped for a private-use placeholder character, so the
   renderer (native or Jinja) sees no marker it did not write itself.
2. The rendered prompt is split at the special spellings left, which are the renderer's; each
   becomes its token id. The text between them, placeholders put back, is encoded with the same
   tokenizer minus its added vocabulary, as DeepSeek's encoder does.

A marker a DeepSeek V4 encoding writes but the tokenizer lacks is refused with an error naming it
(V4.1's `<｜System｜>` is not in V4's tokenizer; it comes from the checkpoint's own); the older
encodings encode such a marker as text, as before.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation
from deepinfer.validation import PromptTooLong

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Supplementary Private Use Area-B: no tokenizer gives these a meaning, and the placeholders
# can be told from client text that uses the same plane (which is escaped too).
_PLANE = 0x100000
_PLANE_END = 0x10FFFD
_ESCAPE = chr(_PLANE)  # stands for itself: the client's own U+100000
# Characters one regex search scans at most: a search holds the GIL, and a server renders
# prompts on a thread beside its event loop, so a megabyte prompt is scanned in short steps.
_WINDOW = 1 << 14  # an alternation of a few dozen spellings: about 1 ms a search, 10 under load


def _matches(pattern: re.Pattern[str], text: str, longest: int) -> Iterator[re.Match[str]]:
    """`pattern.finditer(text)` in searches of about _WINDOW characters. A match starting in a
    window ends within `longest - 1` characters past it, so bounding each search there finds
    the same matches as one search over the whole text."""
    pos, size = 0, len(text)
    while pos < size:
        end = min(size, pos + _WINDOW)
        match = pattern.search(text, pos, min(size, end + longest - 1))
        if match is None or match.start() >= end:
            pos = end
            continue
        yield match
        pos = max(match.end(), match.start() + 1)


class MissingSpecialToken(RecipeError):
    """The model's tokenizer lacks a control token the prompt format needs."""


class SpecialTextGuard:
    """Swaps special spellings in client text for placeholders, and back."""

    def __init__(self, specials: Iterable[str]) -> None:
        ordered = sorted({s for s in specials if s}, key=len, reverse=True)
        if len(ordered) > _PLANE_END - _PLANE - 1:
            raise ValueError("too many special tokens for the placeholder range")
        self.specials = tuple(ordered)
        self._placeholder = {s: chr(_PLANE + 1 + i) for i, s in enumerate(ordered)}
        self._spelling = {v: k for k, v in self._placeholder.items()}
        self._spelling[_ESCAPE] = _ESCAPE
        self._special_re = re.compile("|".join(re.escape(s) for s in ordered)) if ordered else None
        self._longest = max((len(s) for s in ordered), default=1)
        plane = f"[{re.escape(chr(_PLANE))}-{re.escape(chr(_PLANE_END))}]"
        self._in_re = re.compile("|".join([*(re.escape(s) for s in ordered), plane]) if ordered else plane)
        self._out_re = re.compile(plane)

    # -- client text -> placeholders

    def protect_text(self, text: str) -> str:
        out: list[str] = []
        pos = 0
        for match in _matches(self._in_re, text, self._longest):
            out += (text[pos : match.start()], self._swap_in(match))
            pos = match.end()
        out.append(text[pos:])
        return "".join(out)

    def _swap_in(self, match: re.Match[str]) -> str:
        found = match.group(0)
        if found in self._placeholder:
            return self._placeholder[found]
        # A character of the placeholder plane the client sent: kept, escaped.
        return _ESCAPE + found

    def restore(self, text: str) -> str:
        out: list[str] = []
        pos = 0
        escaped = False
        for match in _matches(self._out_re, text, 1):
            char = match.group(0)
            out.append(text[pos : match.start()])
            pos = match.end()
            if escaped:
                out.append(char)
                escaped = False
            elif char == _ESCAPE:
                escaped = True
            else:
                out.append(self._spelling.get(char, char))
        out.append(text[pos:])
        return "".join(out)

    def protect(self, conv: Conversation) -> Conversation:
        """A copy of `conv` with every client string protected (the original is not changed)."""
        return _map_strings(conv, self.protect_text)

    # -- rendered prompt -> segments

    def segments(self, rendered: str) -> list[tuple[str, bool]]:
        """(text, is_special) pieces of a rendered prompt, client text restored."""
        pieces: list[tuple[str, bool]] = []
        pos = 0
        if self._special_re is not None:
            for match in _matches(self._special_re, rendered, self._longest):
                if match.start() > pos:
                    pieces.append((self.restore(rendered[pos : match.start()]), False))
                pieces.append((match.group(0), True))
                pos = match.end()
        if pos < len(rendered):
            pieces.append((self.restore(rendered[pos:]), False))
        return pieces


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_strings(v, fn) for v in value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _map_strings(getattr(value, f.name), fn) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def added_token_spellings(tokenizer: Tokenizer) -> tuple[str, ...]:
    return tuple(t.content for t in tokenizer.get_added_tokens_decoder().values())


class PromptTokenizer:
    """Encodes rendered prompts for one tokenizer: markers as ids, text without added tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers import Tokenizer as HfTokenizer  # lazy: the recipe imports without it

        self.tokenizer = tokenizer
        self.added = added_token_spellings(tokenizer)
        config = json.loads(tokenizer.to_str())
        config["added_tokens"] = []
        self._text = HfTokenizer.from_str(json.dumps(config))

    def encode(
        self, pieces: list[tuple[str, bool]], *, strict: bool, max_tokens: int | None = None
    ) -> list[int]:
        """Ids of rendered pieces. A marker the tokenizer lacks is refused when `strict` (DeepSeek
        V4's rule), else encoded as text (a V3 checkpoint without V3.2's DSML token). Past
        `max_tokens`, PromptTooLong with the whole count (see tokenizer.ids_within)."""
        ids: list[int] = []
        counted = 0  # tokens past max_tokens, counted and not kept
        for text, special in pieces:
            token_id = self.tokenizer.token_to_id(text) if special else None
            if token_id is None and special and strict:
                raise MissingSpecialToken(
                    f"the model's tokenizer has no special token {text!r}, which this prompt format "
                    "needs; use the checkpoint's own tokenizer, or another chat encoding",
                    param=None,
                )
            if token_id is not None:
                if counted or (max_tokens is not None and len(ids) >= max_tokens):
                    counted += 1
                else:
                    ids.append(token_id)
                continue
            if not text:
                continue
            # The text's tokenizer releases the GIL while it works (encode_batch_fast).
            encoding = self._text.encode_batch_fast([text], add_special_tokens=False)[0]
            if counted or (max_tokens is not None and len(ids) + len(encoding) > max_tokens):
                counted += len(encoding)
            else:
                ids.extend(encoding.ids)
        if counted:
            raise PromptTooLong(len(ids) + counted)
        return ids


@lru_cache(maxsize=8)
def _prompt_tokenizer(tokenizer: Tokenizer) -> PromptTokenizer:
    return PromptTokenizer(tokenizer)


def prompt_tokenizer(tokenizer: Tokenizer) -> PromptTokenizer:
    """The (cached) PromptTokenizer of `tokenizer`: building one copies its vocabulary once."""
    return _prompt_tokenizer(tokenizer)
