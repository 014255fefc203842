"""RoPE scaling given on the command line (`--rope-scaling '{"rope_type":"yarn","factor":4.0}'`) or
to `LLM(rope_scaling={...})`, and the context length a model may then be run at.

Torch-free: the config checks the JSON where it is given; the model applies it when it loads
(`ModelConfig.scale_rope`), and the context check runs twice, in the API process from the
checkpoint's own metadata before the engine starts, and in the engine on the loaded config.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.config.fields import ConfigError

# The kinds the Llama rotary (model/layers/rotary.py) computes, and the keys each may carry.
ROPE_TYPES = ("linear", "llama3", "yarn")
_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    },
}


def parse_rope_scaling(value: str | dict[str, Any]) -> dict[str, Any]:
    """A checked copy of the scaling (JSON text or a dict); `type` is read as `rope_type`, as HF does.
    Raises ConfigError naming `rope_scaling` and what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError("rope_scaling", f"not valid JSON ({exc.msg}): {value!r}") from None
    if not isinstance(value, dict):
        raise ConfigError("rope_scaling", f"expected a JSON object, got {value!r}")
    scaling = dict(value)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.pop("rope_type", None)
    if kind not in ROPE_TYPES:
        raise ConfigError("rope_scaling", f"rope_type must be one of {list(ROPE_TYPES)}, got {kind!r}")
    unknown = sorted(set(scaling) - _KEYS[kind])
    if unknown:
        raise ConfigError("rope_scaling", f"unknown keys for {kind}: {unknown}; known: {sorted(_KEYS[kind])}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor >= 1:
        raise ConfigError("rope_scaling", f"factor must be a number >= 1, got {factor!r}")
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ConfigError(
            "rope_scaling", f"original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    for key in _KEYS[kind] - {"factor", "original_max_position_embeddings"}:
        number = scaling.get(key)
        if number is not None and (isinstance(number, bool) or not isinstance(number, int | float)):
            raise ConfigError("rope_scaling", f"{key} must be a number, got {number!r}")
    return {"rope_type": kind, **scaling}


def scaled_context(trained: int, scaling: dict[str, Any]) -> int:
    """The positions a scaling stretches the model to: factor x the trained context (the one the
    scaling names, else the checkpoint's), as vLLM derives its max_model_len."""
    return int(scaling.get("original_max_position_embeddings", trained) * scaling["factor"])


def check_context_length(max_model_len: int | None, limit: int, scaling: dict[str, Any] | None) -> None:
    """Refuse a --max-model-len past what the model can place (`limit`: its trained context, or
    the scaled one), naming both numbers and the way to go further."""
    if max_model_len is None or max_model_len <= limit:
        return
    if scaling is None:
        raise ConfigError(
            "max_model_len",
            f"{max_model_len} tokens is beyond the model's trained context of {limit} tokens; "
            f"stretch it with RoPE scaling, e.g. --rope-scaling "
            f'\'{{"rope_type":"yarn","factor":{-(-max_model_len // limit)}.0,'
            f'"original_max_position_embeddings":{limit}}}\'',
        )
    raise ConfigError(
        "max_model_len",
        f"{max_model_len} tokens is beyond the {limit} tokens this --rope-scaling reaches "
        f"(factor {scaling['factor']} x the trained context); raise its factor",
    )
