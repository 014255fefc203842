"""Incremental scanner for one `{"name": …, "arguments": {…}}` object (Hermes and Llama-3.1 calls).

It walks the top-level object character by character, so it knows the call's name as soon as
its string closes and can hand out the raw text of the arguments value while it is still being
generated. It does not validate nested JSON; the finished object is checked with `json.loads`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_SPACE = " \t\r\n"
_SCALAR_START = "-0123456789tfn"

# Top-level states.
_OPEN, _FIRST_KEY, _KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _AFTER_VALUE = range(8)
# Value kinds.
_STRING, _CONTAINER, _SCALAR = range(3)


@dataclass(slots=True)
class ScanResult:
    consumed: int = 0
    name: str | None = None  # set once, in the step the name's string closes
    args_pieces: list[str] = field(default_factory=list)  # raw text of an object-valued `arguments`


class JsonCallScanner:
    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self._state = _OPEN
        self._raw: list[str] = []  # the whole object, for the final validation
        self._token: list[str] = []  # the key or value being read
        self._key = ""
        self._kind = _SCALAR
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.name: str | None = None
        self.args_kind: str | None = None  # "object", "string" (JSON text inside a string) or None
        self.args_text = ""  # the final arguments (raw object text, or the decoded string)
        self.done = False
        self.error: str | None = None

    def feed(self, text: str) -> ScanResult:
        """Consume `text` up to the end of the object (or an error)."""
        result = ScanResult()
        i = 0
        while i < len(text) and not self.done and self.error is None:
            i = self._step(text, i, result)
        result.consumed = i
        self._raw.append(text[:i])
        if self.done:
            self._validate()
        return result

    def _fail(self, why: str, i: int) -> int:
        self.error = why
        return i

    def _step(self, text: str, i: int, result: ScanResult) -> int:
        c = text[i]
        state = self._state
        if state in (_OPEN, _FIRST_KEY, _KEY, _COLON, _VALUE, _AFTER_VALUE) and c in _SPACE:
            return i + 1
        if state == _OPEN:
            if c != "{":
                return self._fail("a tool call must be a JSON object", i)
            self._state = _FIRST_KEY
            return i + 1
        if state in (_FIRST_KEY, _KEY):
            if c == "}" and state == _FIRST_KEY:
                self.done = True
                return i + 1
            if c != '"':
                return self._fail("expected a key", i)
            self._state, self._token, self._escaped = _IN_KEY, ['"'], False
            return i + 1
        if state == _IN_KEY:
            end, closed = self._string_end(text, i)
            self._token.append(text[i:end])
            if not closed:
                return end
            self._key = json.loads("".join(self._token))
            self._state = _COLON
            return end
        if state == _COLON:
            if c != ":":
                return self._fail("expected ':'", i)
            self._state = _VALUE
            return i + 1
        if state == _VALUE:
            return self._start_value(c, i, result)
        if state == _IN_VALUE:
            return self._continue_value(text, i, result)
        # _AFTER_VALUE
        if c == ",":
            self._state = _KEY
            return i + 1
        if c == "}":
            self.done = True
            return i + 1
        return self._fail("expected ',' or '}'", i)

    def _string_end(self, text: str, i: int) -> tuple[int, bool]:
        """(index just past the closing quote, True), or (len(text), False) while the string goes on."""
        escaped = self._escaped
        for j in range(i, len(text)):
            ch = text[j]
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                self._escaped = False
                return j + 1, True
        self._escaped = escaped
        return len(text), False

    def _is_args_key(self) -> bool:
        return self._key in self.ARGUMENT_KEYS

    def _start_value(self, c: str, i: int, result: ScanResult) -> int:
        if (self._key == "name" and self.name is not None) or (
            self._is_args_key() and self.args_kind is not None
        ):
            return self._fail(f"duplicate key {self._key!r}", i)
        if c == '"':
            self._kind, self._escaped = _STRING, False
        elif c in "{[":
            self._kind, self._depth, self._in_string, self._escaped = _CONTAINER, 1, False, False
        elif c in _SCALAR_START:
            self._kind = _SCALAR
        else:
            return self._fail("expected a value", i)
        self._token = [c]
        if self._is_args_key() and self._kind == _CONTAINER:
            if c != "{":
                return self._fail("arguments must be a JSON object", i)
            result.args_pieces.append(c)
        self._state = _IN_VALUE
        return i + 1

    def _continue_value(self, text: str, i: int, result: ScanResult) -> int:
        if self._kind == _STRING:
            end, closed = self._string_end(text, i)
            self._token.append(text[i:end])
            if closed:
                self._finish_value(result)
            return end
        if self._kind == _SCALAR:
            j = i
            while j < len(text) and text[j] not in ",}" and text[j] not in _SPACE:
                j += 1
            self._token.append(text[i:j])
            if j < len(text):
                self._finish_value(result)
            return j
        j = self._container_end(text, i)
        piece = text[i:j]
        self._token.append(piece)
        if self._is_args_key():
            result.args_pieces.append(piece)
        if self._depth == 0:
            self._finish_value(result)
        return j

    def _container_end(self, text: str, i: int) -> int:
        """Index just past the container's closing bracket, or len(text) if it goes on."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for j in range(i, len(text)):
            ch = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self._depth, self._in_string, self._escaped = 0, False, False
                    return j + 1
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        return len(text)

    def _finish_value(self, result: ScanResult) -> None:
        raw = "".join(self._token)
        self._state = _AFTER_VALUE
        if self._key == "name":
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = None
            if not isinstance(value, str) or not value:
                self.error = "the tool name must be a non-empty string"
                return
            self.name = result.name = value
        elif self._is_args_key():
            if self._kind == _CONTAINER:
                self.args_kind, self.args_text = "object", raw
            elif self._kind == _STRING:
                # Some models send the arguments as a JSON string holding the object.
                self.args_kind, self.args_text = "string", _decoded_object_text(raw)
                if not self.args_text:
                    self.error = "arguments must be a JSON object"
            else:
                self.error = "arguments must be a JSON object"

    def _validate(self) -> None:
        try:
            json.loads("".join(self._raw))
        except json.JSONDecodeError as exc:
            self.error = f"invalid JSON: {exc.msg}"


def _decoded_object_text(raw_string: str) -> str:
    """The object text inside a JSON string literal, or "" if it holds no JSON object."""
    try:
        inner = json.loads(raw_string)
        return inner if isinstance(json.loads(inner), dict) else ""
    except (json.JSONDecodeError, TypeError):
        return ""
