"""The registered model families and the lookups every layer makes through them."""

from __future__ import annotations

from deepinfer.families.record import ModelFamily

_BY_NAME: dict[str, ModelFamily] = {}
_BY_MODEL_TYPE: dict[str, ModelFamily] = {}  # model types and encoding-only names, lower case


def register_family(family: ModelFamily) -> ModelFamily:
    """Add `family` to the registry (mutates the name and model-type indexes); a ValueError when
    its name or one of its model types is taken already (a family is replaced by unregistering
    it first)."""
    if family.name in _BY_NAME:
        raise ValueError(f"a model family named {family.name!r} is registered already")
    names = [t.lower() for t in (*family.model_types, *family.encoding_model_types)]
    taken = sorted(n for n in names if n in _BY_MODEL_TYPE)
    if taken:
        raise ValueError(f"model types {taken} belong to registered families already")
    _BY_NAME[family.name] = family
    for name in names:
        _BY_MODEL_TYPE[name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove the family called `name` and its model types from the registry (mutates both
    indexes); a KeyError when none is registered under that name."""
    family = _BY_NAME.pop(name)
    for model_type in [t for t, f in _BY_MODEL_TYPE.items() if f is family]:
        del _BY_MODEL_TYPE[model_type]


def registered_families() -> tuple[ModelFamily, ...]:
    """Every registered family, in registration order."""
    return tuple(_BY_NAME.values())


def family_for_model_type(model_type: str | None) -> ModelFamily | None:
    """The family whose model class serves `model_type` (None: no registered family does)."""
    family = _BY_MODEL_TYPE.get((model_type or "").lower())
    return family if family is not None and model_type in family.model_types else None


def supported_model_types() -> list[str]:
    """The model types some registered model class serves, sorted."""
    return sorted(t for family in _BY_NAME.values() for t in family.model_types)


def choose_encoding(model_type: str | None, chat_template: str | None) -> str | None:
    """The recipe encoding a checkpoint's family chooses for it (None: no family claims its
    type, or the family speaks through the model's own chat template)."""
    key = (model_type or "").lower()
    family = _BY_MODEL_TYPE.get(key)
    if family is None:
        # Later model types of a family (longest prefix first, so a more specific one wins).
        prefixed = [(p, f) for f in _BY_NAME.values() for p in f.encoding_prefixes if key.startswith(p)]
        if not prefixed:
            return None
        family = max(prefixed, key=lambda pair: len(pair[0]))[1]
    return family.choose_encoding(key, chat_template)
