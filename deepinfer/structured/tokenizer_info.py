"""What a grammar backend needs to know about the tokenizer, and its fingerprint for cache keys."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class TokenizerInfo:
    """The tokenizer as a grammar backend sees it.

    `vocab_size` is the width of the model's logits. It may exceed the tokenizer's own vocabulary
    (embedding tables are padded to a round size): the extra ids have no text and are never allowed,
    and every bitmask row is `ceil(vocab_size / 32)` int32 words wide.
    """

    tokenizer_json: str  # the HF `tokenizers` serialization (tokenizer.json text)
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    fingerprint: str = field(default="")
    # Texts of the tokens marked special (grammars must name these as tokens, not as text).
    special_tokens: frozenset[str] = field(default=frozenset())

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("TokenizerInfo needs at least one EOS token id")
        if not self.special_tokens:
            added = json.loads(self.tokenizer_json).get("added_tokens") or []
            special = frozenset(t["content"] for t in added if t.get("special"))
            object.__setattr__(self, "special_tokens", special)
        if not self.fingerprint:
            digest = hashlib.sha256(self.tokenizer_json.encode())
            digest.update(f"|{self.vocab_size}|{sorted(self.eos_token_ids)}".encode())
            object.__setattr__(self, "fingerprint", digest.hexdigest()[:32])

    @property
    def bitmask_words(self) -> int:
        return bitmask_words(self.vocab_size)

    @classmethod
    def from_backend_tokenizer(
        cls, backend: Any, eos_token_ids: list[int] | tuple[int, ...], model_vocab_size: int | None = None
    ) -> TokenizerInfo:
        """From a `tokenizers.Tokenizer` (also `deepinfer.tokenizer.Tokenizer.backend`, or a HF fast
        tokenizer's `backend_tokenizer`). `model_vocab_size` defaults to the tokenizer's size."""
        tokenizer_size = backend.get_vocab_size(with_added_tokens=True)
        vocab = max(tokenizer_size, model_vocab_size or 0)
        return cls(backend.to_str(), tuple(eos_token_ids), vocab)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, model_vocab_size: int | None = None) -> TokenizerInfo:
        """From `deepinfer.tokenizer.Tokenizer` (its `.backend` and `.eos_token_ids`)."""
        return cls.from_backend_tokenizer(tokenizer.backend, tokenizer.eos_token_ids, model_vocab_size)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: 32 tokens per word, token t is bit t % 32 of word t // 32."""
    return (vocab_size + 31) // 32
