"""model_type -> model class. Models register themselves on import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.model.base import CausalLM

_REGISTRY: dict[str, type[CausalLM]] = {}
# Modules that define models, imported lazily the first time a model_type is looked up.
_MODEL_MODULES = (
    "deepinfer.model.llama",
    "deepinfer.model.deepseek_v3",
    "deepinfer.model.deepseek_v4",
    "deepinfer.model.deepseek_v41",
)


def register_model(*model_types: str):
    def wrap(cls: type[CausalLM]) -> type[CausalLM]:
        for model_type in model_types:
            _REGISTRY[model_type] = cls
        return cls

    return wrap


def model_class(model_type: str) -> type[CausalLM]:
    if model_type not in _REGISTRY:
        for module in _MODEL_MODULES:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
    if model_type not in _REGISTRY:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]
