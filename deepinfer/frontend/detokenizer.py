"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks characters whose bytes span tokens (emoji, CJK) and drops the
spaces some tokenizers attach to the following token. So each step decodes a short window: the
text of tokens [prefix_offset:] minus the text of [prefix_offset:read_offset]; if the new text
ends in U+FFFD, its bytes are incomplete and it is held back until the next token completes it.
"""

from __future__ import annotations

from deepinfer.tokenizer import Tokenizer

# A few tokens of left context is enough for tokenizers that merge spaces into the next token.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or an incomplete character: wait for more bytes
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        # Keep the window short: drop tokens that can no longer affect decoding.
        if self.prefix_offset > 4 * _CONTEXT_TOKENS:
            drop = self.prefix_offset - _CONTEXT_TOKENS
            del self.token_ids[:drop]
            self.prefix_offset -= drop
            self.read_offset -= drop
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """At the end of the sequence, emit whatever is held back (even an incomplete character)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        new_text = full_text[len(prefix_text) :]
        self.read_offset = len(self.token_ids)
        self.text += new_text
        return new_text
