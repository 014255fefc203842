"""model_type -> model class, through the model-family records (deepinfer.families): the class
is imported from the record's lazy "module:Class" path the first time it is asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.families import family_for_model_type, supported_model_types

if TYPE_CHECKING:
    from deepinfer.model.base import CausalLM


def model_class(model_type: str) -> type[CausalLM]:
    """The model class of the family registered for `model_type`; a ValueError naming the
    supported types when no family serves it."""
    family = family_for_model_type(model_type)
    if family is None:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {supported_model_types()}")
    return family.load_model_class()
