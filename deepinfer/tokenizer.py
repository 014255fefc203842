"""The tokenizer: a `tokenizers.Tokenizer` plus the metadata the engine and the recipe need."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from deepinfer.validation import PromptTooLong


@dataclass(slots=True)
class TokenizerMeta:
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": self.eos_token_ids,
            "chat_template": self.chat_template,
        }


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, meta: TokenizerMeta) -> None:
        self.backend = backend
        self.meta = meta

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json plus our tokenizer_meta.json, or HF's tokenizer_config.json."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        ours = path / "tokenizer_meta.json"
        if ours.exists():
            data = json.loads(ours.read_text())
            return cls(
                backend, TokenizerMeta(data["bos_token_id"], data["eos_token_ids"], data["chat_template"])
            )
        return cls(backend, _meta_from_hf_dir(path, backend))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_meta.json").write_text(json.dumps(self.meta.to_json()))

    @cached_property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.meta.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.meta.bos_token_id

    @property
    def chat_template(self) -> str | None:
        return self.meta.chat_template

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """The text's ids; PromptTooLong past `max_tokens`, before they become a list."""
        encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        return ids_within(encoding, max_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def ids_within(encoding: tokenizers.Encoding, max_tokens: int | None) -> list[int]:
    """`encoding.ids`, or PromptTooLong when there are more than `max_tokens`.

    How a server's thread tokenizes without holding up its event loop: `encode_batch_fast`
    releases the GIL while it works (`encode` does not) and keeps no offsets (`encode_batch`
    does: three times the work, and ten times the GIL-held free afterwards), but turning the ids
    into a list holds the GIL throughout, about 15 ms a million tokens. A prompt of megabytes is
    millions of tokens past any context: counted, then refused without that list."""
    if max_tokens is not None and len(encoding) > max_tokens:
        raise PromptTooLong(len(encoding))
    return encoding.ids


def _token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _meta_from_hf_dir(path: Path, backend: tokenizers.Tokenizer) -> TokenizerMeta:
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text()
    eos_ids: list[int] = []
    generation_file = path / "generation_config.json"
    if generation_file.exists():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    config_eos = _token_id(backend, config.get("eos_token"))
    if config_eos is not None and config_eos not in eos_ids:
        eos_ids.insert(0, config_eos)
    return TokenizerMeta(_token_id(backend, config.get("bos_token")), eos_ids, template)
