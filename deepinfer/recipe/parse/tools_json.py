"""JSON tool calls: Hermes/Qwen `<tool_call>` blocks and Llama-3.1 bare JSON.

Hermes: `<tool_call>\\n{"name": NAME, "arguments": {…}}\\n</tool_call>`, one call per block.
Llama-3.1: the reply starts with `{"name": NAME, "parameters": {…}}` (or follows
`<|python_tag|>`); further calls follow after `;`. A bare JSON reply is only a call when NAME is
one of the request's tools, so a JSON answer to a JSON question stays text.

The arguments are the raw text of the `arguments`/`parameters` object, streamed as generated.
When a model sends them as a string holding the object, they are the decoded text, sent in one
delta once the string closes. A Hermes call without arguments gets `{}`.
"""

from __future__ import annotations

from collections.abc import Collection

from deepinfer.recipe.parse.json_call import JsonCallScanner, ScanResult
from deepinfer.recipe.parse.scan import CallSink, Status, expect

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class _JsonCall:
    """Streams one JSON call from a scanner: the start once the name is known, then the arguments."""

    def __init__(self) -> None:
        self.scanner = JsonCallScanner()
        self.started = False
        self._pending: list[str] = []

    def feed(self, text: str, sink: CallSink, allowed: Collection[str] | None) -> tuple[int, bool]:
        """Consume text; returns (consumed, ok). `allowed`: the names that make this a call."""
        result: ScanResult = self.scanner.feed(text)
        if self.scanner.error is not None:
            return result.consumed, False
        if result.name is not None:
            if allowed is not None and result.name not in allowed:
                return result.consumed, False
            sink.start(result.name)
            self.started = True
        if self.started:
            for piece in [*self._pending, *result.args_pieces]:
                sink.args(piece)
            self._pending = []
        else:
            self._pending.extend(result.args_pieces)
        return result.consumed, True

    def arguments(self, sink: CallSink, *, default_empty: bool) -> str | None:
        """The final arguments once the object is closed, sending the delta still owed."""
        scanner = self.scanner
        if scanner.name is None:
            return None
        if scanner.args_kind == "string":
            sink.args(scanner.args_text)
            return scanner.args_text
        if scanner.args_kind is None:
            if not default_empty:
                return None
            sink.args("{}")
            return "{}"
        return scanner.args_text


class HermesBlock:
    def __init__(self) -> None:
        self._call = _JsonCall()
        self._arguments: str | None = None

    def step(self, buf: str, sink: CallSink, final: bool) -> tuple[int, Status]:
        pos = 0
        if self._arguments is None:
            used, ok = self._call.feed(buf, sink, None)
            pos += used
            if not ok:
                return pos, Status.BAD
            if not self._call.scanner.done:
                return pos, Status.BAD if final else Status.MORE
            self._arguments = self._call.arguments(sink, default_empty=True)
            if self._arguments is None:
                return pos, Status.BAD
        rest = buf[pos:]
        literal, used, pending = expect(rest, (HERMES_CLOSE,))
        if literal is None and not final:
            return pos, Status.MORE if pending else Status.BAD
        # The object is whole: a missing close tag at the very end does not void the call, and a
        # close tag cut there (by max_tokens) is the call's, not text.
        if literal is None and pending:
            used = len(rest)
        sink.end(self._arguments)
        return pos + used, Status.BLOCK_DONE


class LlamaJsonBlock:
    def __init__(self, tool_names: Collection[str]) -> None:
        self._names = tool_names
        self._call: _JsonCall | None = _JsonCall()
        self._after_semicolon = False

    def step(self, buf: str, sink: CallSink, final: bool) -> tuple[int, Status]:
        pos = 0
        while True:
            rest = buf[pos:]
            if self._call is not None:
                used, ok = self._call.feed(rest, sink, self._names)
                pos += used
                if not ok:
                    return pos, Status.BAD
                if not self._call.scanner.done:
                    return pos, Status.BAD if final else Status.MORE
                arguments = self._call.arguments(sink, default_empty=False)
                if arguments is None:
                    return pos, Status.BAD
                sink.end(arguments)
                self._call = None
                return pos, Status.CALL_DONE
            stripped = rest.lstrip()
            if not stripped:
                if final:
                    return pos, Status.BAD if self._after_semicolon else Status.BLOCK_DONE
                return pos, Status.MORE
            skipped = len(rest) - len(stripped)
            if stripped[0] == "{":
                pos += skipped
                self._call, self._after_semicolon = _JsonCall(), False
            elif stripped[0] == ";" and not self._after_semicolon:
                pos += skipped + 1
                self._after_semicolon = True
            elif self._after_semicolon:
                return pos, Status.BAD
            else:
                return pos, Status.BLOCK_DONE
