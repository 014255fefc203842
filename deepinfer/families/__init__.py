"""The model-family registry: one record per family, consulted everywhere a family matters.

Design
------
A family's identity lives in one `ModelFamily` record (record.py): the model types it serves,
its model class as a lazy "module:Class" path (the class declares its own cache groups), how the
recipe encoding is chosen for a checkpoint (from its model type and chat template), the
tool-call syntax of its template where the template does not say, its vision tower (lazy
path), and whether its config reads its own layer types. Adding a family is its folder (model
code, and a recipe encoding in `deepinfer.recipe.encodings` if it speaks a new one) plus one
`register_family(record)` call; the built-in records are registered in builtin.py only.

Reasoning is part of an encoding (its parser's `<think>` handling and output rules), so a family
picks its reasoning parser by picking its encoding. Forced tool calls are grammars per tool
syntax (`deepinfer.structured.tool_calls`), shared by every family that writes that syntax.

Who reads the records: `deepinfer.model.registry.model_class` (the class for a model type),
`deepinfer.model.config` (own layer types), `deepinfer.recipe.family.resolve_family` (the
encoding), `deepinfer.encoder.tower` (which checkpoints have a vision tower).

Import floor: this package imports only the standard library, so it sits below `recipe`,
`model`, `encoder` and `server`, which all import it; it never imports any of them (the model
classes are strings here, imported by `ModelFamily.load_model_class` when a model is built).
"""

from __future__ import annotations

from deepinfer.families import builtin  # noqa: F401  (registers the built-in records)
from deepinfer.families.record import EncodingChooser, ModelFamily, load_object
from deepinfer.families.registry import (
    choose_encoding,
    family_for_model_type,
    register_family,
    registered_families,
    supported_model_types,
    unregister_family,
)

__all__ = [
    "EncodingChooser",
    "ModelFamily",
    "choose_encoding",
    "family_for_model_type",
    "load_object",
    "register_family",
    "registered_families",
    "supported_model_types",
    "unregister_family",
]
