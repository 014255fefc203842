"""The JSON Schema suite: schemas we promise to enforce, ones we must refuse, and one too costly."""

from __future__ import annotations

from typing import Any

_person = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

SUITE: dict[str, dict[str, Any]] = {
    "empty_object": {"type": "object", "additionalProperties": False},
    "any_object": {"type": "object"},
    "flat_required": _person,
    "optional_mix": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string"},
            "active": {"type": "boolean"},
            "score": {"type": "number"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "all_optional": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
        "additionalProperties": False,
    },
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": _person,
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "geo": {
                        "type": "object",
                        "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"],
                        "additionalProperties": False,
                    },
                },
                "required": ["geo"],
                "additionalProperties": False,
            },
        },
        "required": ["user", "address"],
        "additionalProperties": False,
    },
    "array_of_strings": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "array_min_max": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
    "array_exact": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "maxLength": 8},
                "qty": {"type": "integer", "minimum": 1},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    },
    "matrix": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        "minItems": 1,
        "maxItems": 3,
    },
    "string_enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": ["a", 1, True, None, 2.5]},
    "enum_in_object": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", "pending"]},
            "priority": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["status", "priority"],
        "additionalProperties": False,
    },
    "const_value": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "kind": {"const": 7}},
        "required": ["version", "kind"],
        "additionalProperties": False,
    },
    "any_of_scalars": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}, {"type": "null"}]},
    "any_of_objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"circle": {"type": "number", "minimum": 0}},
                "required": ["circle"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"square": {"type": "integer", "minimum": 1}},
                "required": ["square"],
                "additionalProperties": False,
            },
        ]
    },
    "one_of_disjoint": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "all_of_merge": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    },
    "type_list": {
        "type": "object",
        "properties": {"maybe": {"type": ["string", "null"]}},
        "required": ["maybe"],
        "additionalProperties": False,
    },
    "ref_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "ref_definitions_legacy": {
        "definitions": {"tag": {"type": "string", "pattern": "^[a-z]{2,6}$"}},
        "type": "array",
        "items": {"$ref": "#/definitions/tag"},
        "maxItems": 3,
    },
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["value"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "pattern_simple": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "pattern_unanchored": {"type": "string", "pattern": "[0-9]", "maxLength": 40},
    "pattern_phone": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{1,3}[ -]?[0-9]{3}[ -]?[0-9]{4}$"}},
        "required": ["phone"],
        "additionalProperties": False,
    },
    "string_lengths": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 3, "maxLength": 3},
            "note": {"type": "string", "maxLength": 12},
            "title": {"type": "string", "minLength": 2},
        },
        "required": ["code", "note", "title"],
        "additionalProperties": False,
    },
    "integer_bounds": {"type": "integer", "minimum": -20, "maximum": 45},
    "exclusive_bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multiple_of": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 1000},
    "numbers_in_object": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -273.15},
            "percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["temperature", "percent", "ratio"],
        "additionalProperties": False,
    },
    "format_date": {"type": "string", "format": "date"},
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_time": {"type": "string", "format": "time"},
    "format_email": {"type": "string", "format": "email"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "format_mix_object": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "email": {"type": "string", "format": "email"},
            "born": {"type": "string", "format": "date"},
        },
        "required": ["id", "email", "born"],
        "additionalProperties": False,
    },
    "additional_properties_typed": {
        "type": "object",
        "properties": {"fixed": {"type": "boolean"}},
        "required": ["fixed"],
        "additionalProperties": {"type": "integer"},
        "maxProperties": 3,
    },
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^x-[a-z]+$": {"type": "string", "maxLength": 4}},
        "additionalProperties": False,
    },
    "top_level_scalar_boolean": {"type": "boolean"},
    "top_level_null": {"type": "null"},
    "unique_items_false_noop": {
        "type": "array",
        "items": {"type": "integer"},
        "uniqueItems": False,
        "maxItems": 3,
    },
    "annotations_ignored": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Annotated",
        "description": "descriptions and examples are annotations, not constraints",
        "type": "object",
        "properties": {
            "q": {"type": "string", "description": "question", "examples": ["why?"], "default": "x"}
        },
        "required": ["q"],
        "additionalProperties": False,
    },
    "event_record": {
        "type": "object",
        "properties": {
            "event": {"enum": ["created", "deleted"]},
            "at": {"type": "string", "format": "date-time"},
            "actor": {"anyOf": [{"$ref": "#/$defs/user"}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^#[a-z]+$"}, "maxItems": 2},
        },
        "required": ["event", "at", "actor"],
        "additionalProperties": False,
        "$defs": {
            "user": {
                "type": "object",
                "properties": {"login": {"type": "string", "minLength": 1, "maxLength": 10}},
                "required": ["login"],
                "additionalProperties": False,
            }
        },
    },
}

# Keywords llguidance cannot enforce: the request must fail, naming the keyword.
UNSUPPORTED: dict[str, tuple[dict[str, Any], str]] = {
    "if_then_else": ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    "dependent_required": ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    "unique_items": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    "not": ({"not": {"type": "string"}}, "'not'"),
    "contains": ({"type": "array", "contains": {"const": 1}}, "'contains'"),
    "property_names": ({"type": "object", "propertyNames": {"pattern": "^a"}}, "'propertyNames'"),
    "unevaluated": ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
    "max_properties_with_optional": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "maxProperties": 1},
        "maxProperties",
    ),
    "unknown_format": ({"type": "string", "format": "color-hex"}, "format 'color-hex'"),
}

# Divisibility by a large number needs a lexer automaton with about a million states per
# property: a tiny schema that costs seconds to compile (about 1 s per property here).
PATHOLOGICAL: dict[str, Any] = {
    "type": "object",
    "properties": {
        f"k{i}": {"type": "integer", "multipleOf": 999983 + 2 * i, "minimum": -(10**15), "maximum": 10**15}
        for i in range(4)
    },
    "required": ["k0"],
}
