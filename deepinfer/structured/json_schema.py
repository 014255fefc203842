"""JSON-output policy shared by the backends: bounded whitespace and schema clean-up.

Whitespace: a JSON grammar that allows any run of whitespace between tokens lets a model emit
spaces or newlines until max_tokens (a known failure of other engines). We allow, at each place
JSON permits whitespace, either up to two spaces or one line break followed by up to 32 spaces or
tabs of indentation: enough for compact, `json.dumps` and pretty-printed styles, never unbounded.
"""

from __future__ import annotations

from typing import Any

# One match per whitespace position (llguidance applies `whitespace_pattern` at most once there).
BOUNDED_JSON_WHITESPACE = r"(?:\x20{1,2}|\r?\n[\x20\x09]{0,32})"


def json_format_options(whitespace_pattern: str = BOUNDED_JSON_WHITESPACE) -> dict[str, Any]:
    """llguidance JSON options (`x-guidance`): fixed separators, bounded whitespace, and no
    `lenient` mode, so unsupported keywords are refused rather than ignored."""
    return {
        "whitespace_pattern": whitespace_pattern,
        "item_separator": ",",
        "key_separator": ":",
        "lenient": False,
    }


def prepare_schema(schema: Any) -> Any:
    """Drop keyword values that constrain nothing, so a backend does not refuse a no-op.

    `uniqueItems: false` is the JSON Schema default; refusing it as "unsupported" would reject
    valid, common schemas for no gain. Everything else is passed through untouched.
    """
    if isinstance(schema, dict):
        return {
            key: _prepare_child(key, value)
            for key, value in schema.items()
            if not (key == "uniqueItems" and value is False)
        }
    return schema


def _prepare_child(key: str, value: Any) -> Any:
    if key in ("const", "enum", "default", "examples"):  # JSON values, not schemas
        return value
    if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(value, dict):
            return {name: prepare_schema(sub) for name, sub in value.items()}
        return value
    if isinstance(value, dict):
        return prepare_schema(value)
    if isinstance(value, list) and key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        return [prepare_schema(v) for v in value]
    return value


# Keywords whose value is one subschema, and those whose value maps names (or lists) to subschemas.
_SCHEMA_KEYS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "prefixItems", "items")
# An object schema that says any of these decides its other keys itself.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref")


def closed_objects(schema: Any, *, in_all_of: bool = False) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that declares
    `properties` and says nothing of other keys: OpenAI's strict semantics (llguidance, like
    JSON Schema, otherwise allows extra keys, and a small model keeps adding them until
    max_tokens). An object without `properties` (`{"type": "object"}`) stays open, as do the
    branches of an `allOf`, which would otherwise exclude each other's keys."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAP_KEYS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LIST_KEYS and isinstance(value, list):
            out[key] = [closed_objects(sub) for sub in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed_objects(sub, in_all_of=True) for sub in value]
        elif key in _SCHEMA_KEYS or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if "properties" in out and not in_all_of and not any(key in out for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
