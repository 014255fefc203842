"""DeepSeek DSML tool calls (V3.2, V4, V4.1), streamed as OpenAI-style JSON arguments.

Every spelling the models write is accepted in every DeepSeek family: the block is
`function_calls` (V3.2), `tool_calls` (V4) or ` calls` (V4.1, whose tags also put a space after
`｜DSML｜`: `<｜DSML｜ invoke …>`). A block whose opening wrapper is missing (the model starts with
an invoke) is read the same way.

Output layout (after `<｜DSML｜function_calls>`):
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    …
    </｜DSML｜invoke>
    …
    </｜DSML｜function_calls>

The arguments become the JSON object DeepSeek's reference decoder builds:
`{"KEY": VALUE, …}` with `", "` and `": "` separators, where a `string="true"` value is the
text as a JSON string and a `string="false"` value is pasted verbatim (it is JSON already).
A call without parameters is `{}`.

A call is reported only once its invoke closed and its arguments are a JSON object (a
`string="false"` value that is not JSON voids it): its start and its whole arguments then go
out together, so no client ever sees a call that turns out malformed or cut. A voided call is
skipped and the block goes on; a block cut by the end of the output keeps the calls completed
before the cut.
"""

from __future__ import annotations

import json
import re

from deepinfer.recipe.parse.scan import CallSink, Status, expect, scan_until

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"
INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
PARAM_CLOSE = f"</{DSML}parameter>"

_GAPS = ("", " ")  # V4.1 writes a space after the DSML token
_BLOCK_WORDS = ("function_calls", "tool_calls", "calls")
CALLS_OPENS = tuple(f"<{DSML}{gap}{word}>" for word in _BLOCK_WORDS for gap in _GAPS)
CALLS_CLOSES = tuple(f"</{DSML}{gap}{word}>" for word in _BLOCK_WORDS for gap in _GAPS)
INVOKE_OPENS = tuple(f'<{DSML}{gap}invoke name="' for gap in _GAPS)
INVOKE_CLOSES = tuple(f"</{DSML}{gap}invoke>" for gap in _GAPS)
PARAM_OPENS = tuple(f'<{DSML}{gap}parameter name="' for gap in _GAPS)
PARAM_CLOSES = tuple(f"</{DSML}{gap}parameter>" for gap in _GAPS)
# What opens DSML in plain text: a block, or an invoke without its block.
OPEN_MARKERS = CALLS_OPENS + INVOKE_OPENS

_PARAM_HEAD = re.compile(r'([^"<>\n]+)" string="(true|false)">')
_MAX_HEAD = 512  # longer than any sane tool or parameter name


def _json_string_body(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class DsmlBlock:
    """`opened_by`: the marker that started the block (an invoke marker starts inside a call)."""

    def __init__(self, opened_by: str | None = None) -> None:
        self._state = "name" if opened_by in INVOKE_OPENS else "between"
        self._completed = 0
        self._args: list[str] = []
        self._keys: set[str] = set()
        self._string_value = False
        self._name = ""

    def _emit(self, sink: CallSink, piece: str) -> None:
        if piece:
            self._args.append(piece)

    def step(self, buf: str, sink: CallSink, final: bool) -> tuple[int, Status]:
        pos = 0
        while True:
            rest = buf[pos:]
            if self._state == "between":
                literal, used, pending = expect(rest, INVOKE_OPENS + CALLS_CLOSES)
                if literal in CALLS_CLOSES:
                    return pos + used, Status.BLOCK_DONE
                if literal is None:
                    # Output that stops between complete calls keeps them.
                    if final and self._completed:
                        return pos, Status.BLOCK_DONE
                    return pos, Status.MORE if pending and not final else Status.BAD
                pos += used
                self._state = "name"
            elif self._state == "name":
                end = rest.find('">')
                if end < 0:
                    if final or len(rest) > _MAX_HEAD or any(c in rest for c in "<>\n"):
                        return pos, Status.BAD
                    return pos, Status.MORE
                name = rest[:end]
                if not name or any(c in name for c in '<>\n"'):
                    return pos, Status.BAD
                self._name = name
                pos += end + 2
                self._state, self._args, self._keys = "params", [], set()
            elif self._state == "params":
                literal, used, pending = expect(rest, PARAM_OPENS + INVOKE_CLOSES)
                if literal is None:
                    return pos, Status.MORE if pending and not final else Status.BAD
                pos += used
                if literal in PARAM_OPENS:
                    self._state = "param_head"
                    continue
                closing = "}" if self._keys else "{}"
                arguments = "".join(self._args) + closing
                try:
                    valid = isinstance(json.loads(arguments), dict)
                except json.JSONDecodeError:
                    valid = False
                self._state = "between"
                if not valid:
                    continue  # a voided call: skipped, the block goes on
                sink.start(self._name)
                sink.args(arguments)
                sink.end(arguments)
                self._completed += 1
                return pos, Status.CALL_DONE
            elif self._state == "skip_call":
                segment = scan_until(rest, INVOKE_CLOSES, final=final)
                pos += segment.consumed
                if segment.marker is None:
                    return pos, Status.BAD if final else Status.MORE
                self._state = "between"
            elif self._state == "param_head":
                match = _PARAM_HEAD.match(rest)
                if match is None:
                    if final or ">" in rest or len(rest) > _MAX_HEAD:
                        return pos, Status.BAD
                    return pos, Status.MORE
                key, string = match.group(1), match.group(2)
                if key in self._keys:
                    self._state = "skip_call"  # a repeated key voids the call
                    continue
                self._string_value = string == "true"
                opening = "{" if not self._keys else ", "
                self._keys.add(key)
                self._emit(
                    sink,
                    f"{opening}{json.dumps(key, ensure_ascii=False)}: " + ('"' if self._string_value else ""),
                )
                pos += match.end()
                self._state = "value"
            else:
                segment = scan_until(rest, PARAM_CLOSES, final=final)
                self._emit(sink, _json_string_body(segment.text) if self._string_value else segment.text)
                pos += segment.consumed
                if segment.marker is None:
                    return pos, Status.BAD if final else Status.MORE
                if self._string_value:
                    self._emit(sink, '"')
                self._state = "params"
