"""The model metadata a recipe is chosen from, read from a GGUF file or a Hugging Face folder.

Only plain files are read (JSON, or a GGUF's header with `struct`: gguf_header.py), so picking
a recipe needs neither torch nor transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.formats.gguf_header import read_header

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
        header, tokens = read_header(path)
        keys = {"unknown": "unk_token", "padding": "pad_token"}
        chat_template = header.values.get("tokenizer.chat_template")
        return cls(
            model_type=header.values.get("general.architecture"),
            chat_template=chat_template if isinstance(chat_template, str) else None,
            special_tokens={keys.get(name, f"{name}_token"): text for name, text in tokens.items()},
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
