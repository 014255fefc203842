"""What the API process checks about a model before it starts the engine process, from plain
files only (JSON, a GGUF's header): that the path is a model at all, and that `--max-model-len`
fits the context the model places.

Starting the engine process imports torch and the whole engine before it reads a byte of the
model (4 s on an idle 2-core machine, over 10 s on a busy one), so a path that is no model used
to take that long to fail; these checks answer in milliseconds. The engine checks again on what
it loads (the authoritative check); this one only fails early.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepinfer.config.rope import check_context_length, scaled_context
from deepinfer.formats.gguf_header import read_header
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader.source import resolve_model_path


def check_model_source(model: str | None) -> Path:
    """The model's resolved path; FileNotFoundError or ValueError, one line naming what is wrong,
    when it is neither a .gguf file nor a Hugging Face checkpoint directory."""
    path = resolve_model_path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file")
        return path
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a directory")
    missing = [
        what
        for what, present in (
            ("config.json", (path / "config.json").is_file()),
            ("*.safetensors weights", any(path.glob("*.safetensors"))),
        )
        if not present
    ]
    if missing:
        raise ValueError(
            f"model path {str(path)!r} is not a Hugging Face checkpoint: it has no {' and no '.join(missing)}"
        )
    _read_config(path)
    return path


def _read_config(path: Path) -> ModelConfig:
    """config.json as the engine reads it; ValueError naming the file and what it lacks."""
    where = path / "config.json"
    try:
        return ModelConfig.from_hf(json.loads(where.read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(where)!r} is not valid JSON ({exc.msg})") from None
    except KeyError as exc:
        raise ValueError(f"{str(where)!r} is not a model's config: it has no {exc.args[0]!r}") from None


def trained_context(path: Path) -> int | None:
    """The context the checkpoint declares (GGUF `<arch>.context_length`, config.json's
    `max_position_embeddings` as the engine reads it); None where it cannot be read here."""
    try:
        if path.is_file():
            header, _ = read_header(path)
            arch = header.values.get("general.architecture")
            value = header.values.get(f"{arch}.context_length")
            return int(value) if value is not None else None
        config = _read_config(path)
    except (OSError, ValueError, TypeError):
        return None  # the engine reports what is wrong with it, in full
    return config.max_position_embeddings


def check_context(path: Path, max_model_len: int | None, rope_scaling: Mapping[str, Any] | None) -> None:
    """ConfigError naming both numbers when `max_model_len` is past what the model places (its
    trained context, or the one `rope_scaling` stretches it to)."""
    if max_model_len is None:
        return
    trained = trained_context(path)
    if trained is None:
        return
    limit = scaled_context(trained, rope_scaling) if rope_scaling is not None else trained
    check_context_length(max_model_len, limit, rope_scaling)
