"""What a request asks the output to follow, as plain data with a canonical cache key.

A `GrammarSpec` is built from `SamplingParams.structured_outputs` (or by the tool-call builder) and
validated for shape at once, so a malformed request fails before it queues for compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from deepinfer.structured.errors import GrammarError

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# Reasoning models think before they answer; this is the marker that ends the thinking section.
DEFAULT_REASONING_END = "</think>"


class StructuredOutputsLike(Protocol):
    """The fields of `deepinfer.sampling_params.StructuredOutputs` this module reads."""

    json: dict[str, Any] | str | None
    json_object: bool
    regex: str | None
    choice: list[str] | None
    grammar: str | None


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """One constraint. Exactly one payload field is meaningful for each kind.

    `after_reasoning`: when set, the output may first hold free text up to and including this
    marker (a reasoning model's thinking section) and only what follows is constrained.
    """

    kind: SpecKind
    schema: dict[str, Any] | None = None  # kind "json" and "json_object"
    text: str | None = None  # kind "regex" (pattern) or "grammar" (Lark or GBNF/EBNF)
    choices: tuple[str, ...] | None = None  # kind "choice"
    after_reasoning: str | None = None
    param: str = "structured_outputs"  # the request field named in errors

    @classmethod
    def json(
        cls, schema: dict[str, Any] | bool | str, *, param: str = "structured_outputs.json"
    ) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise _invalid(param, f"not valid JSON: {e}") from None
        if schema is True:
            schema = {}  # the schema `true` accepts any JSON value
        if schema is False:
            raise _invalid(param, "the JSON Schema `false` accepts no output at all")
        if not isinstance(schema, dict):
            raise _invalid(
                param, f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}"
            )
        return cls("json", schema=schema, param=param)

    @classmethod
    def json_object(cls, *, param: str = "structured_outputs.json_object") -> GrammarSpec:
        return cls("json_object", schema={"type": "object"}, param=param)

    @classmethod
    def regex(cls, pattern: str, *, param: str = "structured_outputs.regex") -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise _invalid(param, "must be a non-empty string")
        return cls("regex", text=pattern, param=param)

    @classmethod
    def choice(
        cls, choices: list[str] | tuple[str, ...], *, param: str = "structured_outputs.choice"
    ) -> GrammarSpec:
        if not isinstance(choices, (list, tuple)) or not choices:
            raise _invalid(param, "must be a non-empty list of strings")
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise _invalid(f"{param}[{i}]", "must be a non-empty string")
        return cls("choice", choices=tuple(choices), param=param)

    @classmethod
    def grammar(cls, text: str, *, param: str = "structured_outputs.grammar") -> GrammarSpec:
        if not isinstance(text, str) or not text.strip():
            raise _invalid(param, "must be a non-empty Lark or EBNF grammar")
        return cls("grammar", text=text, param=param)

    @classmethod
    def from_structured_outputs(
        cls, so: StructuredOutputsLike, *, after_reasoning: str | None = None
    ) -> GrammarSpec:
        """Convert the SamplingParams field; `after_reasoning` is set by whoever knows the model thinks."""
        chosen = [
            name
            for name, value in (
                ("json", so.json),
                ("json_object", so.json_object or None),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
            )
            if value is not None
        ]
        if len(chosen) != 1:
            raise _invalid(
                "structured_outputs",
                f"needs exactly one of json, json_object, regex, choice, grammar; got {chosen}",
            )
        kind = chosen[0]
        if kind == "json":
            spec = cls.json(so.json)  # type: ignore[arg-type]
        elif kind == "json_object":
            spec = cls.json_object()
        elif kind == "regex":
            spec = cls.regex(so.regex)  # type: ignore[arg-type]
        elif kind == "choice":
            spec = cls.choice(so.choice)  # type: ignore[arg-type]
        else:
            spec = cls.grammar(so.grammar)  # type: ignore[arg-type]
        return spec.with_reasoning(after_reasoning) if after_reasoning else spec

    def with_reasoning(self, end_marker: str = DEFAULT_REASONING_END) -> GrammarSpec:
        """The same constraint, starting only after the thinking section ends with `end_marker`."""
        if not end_marker:
            raise _invalid("structured_outputs", "the reasoning end marker must be non-empty")
        return GrammarSpec(self.kind, self.schema, self.text, self.choices, end_marker, self.param)

    @property
    def cache_key(self) -> str:
        """Equal for requests that compile to the same grammar (see `canonical_json`)."""
        if self.kind in ("json", "json_object"):
            payload = canonical_json(self.schema)
        elif self.kind == "choice":
            payload = json.dumps(list(self.choices or ()), ensure_ascii=False)
        else:
            payload = self.text or ""
        return json.dumps([self.kind, self.after_reasoning, payload], ensure_ascii=False)


def canonical_json(value: Any) -> str:
    """Compact JSON with object keys sorted, except the members of a `properties` map.

    Sorting makes logically equal schemas share one cache entry. `properties` keeps its order
    because the grammar emits object members in that order: two schemas that differ only there
    produce different outputs, so they must not share a grammar.
    """
    return json.dumps(_canonical(value, keep_order=False), separators=(",", ":"), ensure_ascii=False)


def canonical_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema in canonical key order; compiling it gives what compiling the cache key would."""
    return _canonical(schema, keep_order=False)


def _canonical(value: Any, *, keep_order: bool) -> Any:
    if isinstance(value, dict):
        keys = list(value) if keep_order else sorted(value)
        return {k: _canonical(value[k], keep_order=(k == "properties" and not keep_order)) for k in keys}
    if isinstance(value, list):
        return [_canonical(v, keep_order=False) for v in value]
    return value


def _invalid(param: str, message: str) -> Exception:
    return GrammarError("invalid", f"{param}: {message}", param=param).to_exception()
