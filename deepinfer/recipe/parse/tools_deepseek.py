"""DeepSeek-V3.1 and R1 tool calls (the special-token syntax), after `<｜tool▁calls▁begin｜>`.

V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` repeated, then
`<｜tool▁calls▁end｜>`. ARGS is the raw JSON text between the separators, streamed as is.

R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`
repeated (newline-separated). ARGS is the fenced text without its trailing whitespace.

Output that stops between complete calls keeps them (R1's own template omits the closing
marker after a single call).
"""

from __future__ import annotations

import json

from deepinfer.recipe.parse.scan import CallSink, Status, expect, scan_until

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END)
_MAX_HEAD = 512


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _read_field(rest: str, terminator: str, final: bool) -> tuple[str | None, int, Status]:
    """(the stripped text before `terminator`, characters used, _) or (None, 0, MORE/BAD) while it is missing."""
    end = rest.find(terminator)
    if end >= 0:
        return rest[:end].strip(), end + len(terminator), Status.MORE
    if final or len(rest) > _MAX_HEAD or any(m in rest for m in _MARKERS):
        return None, 0, Status.BAD
    return None, 0, Status.MORE


class DeepSeekToolBlock:
    def __init__(self, *, r1: bool) -> None:
        self._r1 = r1
        self._state = "between"
        self._completed = 0
        self._args: list[str] = []

    def step(self, buf: str, sink: CallSink, final: bool) -> tuple[int, Status]:
        pos = 0
        while True:
            rest = buf[pos:]
            state = self._state
            if state == "between":
                literal, used, pending = expect(rest, (CALL_BEGIN, CALLS_END))
                if literal == CALLS_END:
                    return pos + used, Status.BLOCK_DONE
                if literal is None:
                    if final and self._completed:
                        return pos, Status.BLOCK_DONE
                    return pos, Status.MORE if pending and not final else Status.BAD
                pos += used
                self._state = "type" if self._r1 else "name"
            elif state == "type":
                kind, used, status = _read_field(rest, TOOL_SEP, final)
                if kind is None:
                    return pos, status
                if kind != "function":
                    return pos, Status.BAD
                pos += used
                self._state = "name"
            elif state == "name":
                name, used, status = _read_field(rest, "\n" if self._r1 else TOOL_SEP, final)
                if name is None:
                    return pos, status
                if not name:
                    return pos, Status.BAD
                sink.start(name)
                pos += used
                self._args = []
                self._state = "fence" if self._r1 else "args"
            elif state == "fence":
                literal, used, pending = expect(rest, ("```json\n",))
                if literal is None:
                    return pos, Status.MORE if pending and not final else Status.BAD
                pos += used
                self._state = "args"
            elif state == "args":
                end = "```" if self._r1 else CALL_END
                segment = scan_until(rest, (end,), final=final, hold_space=self._r1)
                if segment.text:
                    self._args.append(segment.text)
                    sink.args(segment.text)
                pos += segment.consumed
                if segment.marker is None:
                    return pos, Status.BAD if final else Status.MORE
                if not self._r1:
                    return pos, self._end_call(sink)
                self._state = "close"
            else:  # after the closing fence
                literal, used, pending = expect(rest, (CALL_END,))
                if literal is None and not final:
                    return pos, Status.MORE if pending else Status.BAD
                # Output ending right after the fence still holds a whole call.
                return pos + used, self._end_call(sink)

    def _end_call(self, sink: CallSink) -> Status:
        arguments = "".join(self._args)
        if not _is_object(arguments):
            return Status.BAD
        sink.end(arguments)
        self._completed += 1
        self._state = "between"
        return Status.CALL_DONE
