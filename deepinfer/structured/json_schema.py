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
