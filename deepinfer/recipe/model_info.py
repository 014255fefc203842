"""The model metadata a recipe is chosen from, read from a GGUF file or a Hugging Face folder.

Only plain files are read (JSON, or GGUF through the light `gguf` package, imported lazily),
so picking a recipe needs neither torch nor transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader

# The tokenizer_config.json keys transformers passes to chat templates.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(slots=True)
class ModelInfo:
    model_type: str | None = None  # config.json model_type, or the GGUF architecture
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, …
    family: str | None = None  # an explicit recipe family overrides detection

    @classmethod
    def from_gguf(cls, path: str | Path, *, family: str | None = None) -> ModelInfo:
        from gguf import GGUFReader  # lazy: only this path needs it

        return cls.from_gguf_reader(GGUFReader(str(path)), family=family)

    @classmethod
    def from_gguf_reader(cls, reader: GGUFReader, *, family: str | None = None) -> ModelInfo:
        """From an open reader (opening a GGUF takes seconds; a loader reading the weights shares it)."""

        def scalar(key: str) -> Any:
            found = reader.fields.get(key)
            return None if found is None else found.contents()

        special: dict[str, str] = {}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        for name in ("bos", "eos", "unknown", "padding"):
            token_id = scalar(f"tokenizer.ggml.{name}_token_id")
            if tokens is not None and token_id is not None:
                key = {"unknown": "unk_token", "padding": "pad_token"}.get(name, f"{name}_token")
                special[key] = tokens.contents(int(token_id))
        return cls(
            model_type=scalar("general.architecture"),
            chat_template=scalar("tokenizer.chat_template"),
            special_tokens=special,
            family=family,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, *, family: str | None = None) -> ModelInfo:
        folder = Path(path)
        config = _read_json(folder / "config.json")
        tok_config = _read_json(folder / "tokenizer_config.json")
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one is used
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = tok_config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(
            model_type=config.get("model_type"), chat_template=template, special_tokens=special, family=family
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
