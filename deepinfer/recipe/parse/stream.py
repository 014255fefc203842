"""The streaming output parser: (token ids, text) pieces in, canonical events out.

States: an optional reasoning preamble (`<think>` may open the reply), reasoning (until
`</think>`), content (text, watching for the family's tool-block marker), a tool block (parsed
by the family's block parser), and raw text (after a malformed tool block, everything is
text). End-of-turn markers (EOS) end the stream wherever they appear.

Rules every family shares:
- A marker split across pieces never leaks: only a possible marker prefix is held back, so the
  events do not depend on how the stream was cut (up to how text deltas are split).
- Reasoning is trimmed of surrounding whitespace; the text after `</think>` or after a tool
  block loses its leading whitespace, and whitespace right before a tool block is dropped.
- A tool call is valid once `ToolCallEnd` arrives; its deltas add up to its arguments. A block
  that turns out malformed falls back to text (from where it began, or from the end of the
  last complete call) and no further calls are parsed.
- `finish(reason)` flushes what was held back. `stop` becomes `tool_calls` when a call ended.
  A block the end of the output cut (all of it so far could still have become calls: the
  token limit, a stop string or EOS came first) is neither a call nor text: the calls it
  completed count, the cut one never ends (a streaming client saw its start and arguments so
  far, which every API encoder reports as unfinished) and its markup is dropped, like the
  start of an opening marker at the very end (a lone `<` included). Only Llama-3.1's bare `{`
  stays text when cut where it can no longer be the head of a call (`{"name": "TOOL"`), since
  it may be a JSON answer.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepinfer.recipe.encodings import THINK_CLOSE, THINK_OPEN, InitialState, ToolFormat, find_encoding
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.events import (
    Event,
    Finish,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from deepinfer.recipe.parse import tools_deepseek, tools_dsml, tools_json
from deepinfer.recipe.parse.scan import Status, ToolBlock, find_earliest, partial_suffix, scan_until

DSML_FORMATS = ("dsml", "dsml_v4", "dsml_v41")

# The markers that open a tool block in plain text, per format.
OPEN_MARKERS: dict[str, tuple[str, ...]] = {
    "dsml": tools_dsml.OPEN_MARKERS,
    "dsml_v4": tools_dsml.OPEN_MARKERS,
    "dsml_v41": tools_dsml.OPEN_MARKERS,
    "deepseek_v31": (tools_deepseek.CALLS_BEGIN,),
    "deepseek_r1": (tools_deepseek.CALLS_BEGIN,),
    "hermes": (tools_json.HERMES_OPEN,),
    "llama3_json": (tools_json.PYTHON_TAG,),
}


@dataclass(frozen=True, slots=True)
class ParserSpec:
    """Everything a parser needs to know about the prompt it continues."""

    family: str
    tool_format: ToolFormat | None = None  # None: no tools offered, tool syntax is plain text
    initial: InitialState = "content"
    stop_markers: tuple[str, ...] = ()  # end-of-turn texts
    tool_names: tuple[str, ...] = ()  # the offered tools (bare-JSON formats only accept these)
    # (name the model writes, tool name) where they differ (V4's namespaced functions)
    tool_aliases: tuple[tuple[str, str], ...] = ()

    @property
    def v4_rules(self) -> bool:
        """DeepSeek V4's output rules (as its own codec parses): only newlines are trimmed at the
        reasoning and tool-block boundaries, and nothing after a tool block is part of the answer."""
        encoding = find_encoding(self.family)
        return encoding is not None and encoding.v4_rules

    def __post_init__(self) -> None:
        # The family's encoding record says which syntaxes its parser may read (a native
        # encoding exactly one).
        encoding = find_encoding(self.family)
        if encoding is None:
            raise RecipeError(f"unknown recipe family {self.family!r}", param="family")
        if self.tool_format is not None and self.tool_format not in encoding.tool_formats:
            raise RecipeError(
                f"tool format {self.tool_format!r} does not belong to the {self.family} family",
                param="tool_format",
            )


_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id (`call_` + 24 random letters and digits)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class _Calls:
    """The CallSink that turns tool-block reports into events, checking the delta invariant."""

    def __init__(
        self, events: list[Event], id_factory: Callable[[], str], aliases: dict[str, str] | None = None
    ) -> None:
        self._events = events
        self._aliases = aliases or {}
        self._id_factory = id_factory
        self._index = -1
        self._parts: list[str] = []
        self.completed = 0

    @property
    def started(self) -> int:
        return self._index + 1

    def start(self, name: str) -> None:
        self._index += 1
        self._parts = []
        name = self._aliases.get(name, name)
        self._events.append(ToolCallStart(index=self._index, id=self._id_factory(), name=name))

    def args(self, delta: str) -> None:
        if delta:
            self._parts.append(delta)
            self._events.append(ToolCallArgsDelta(index=self._index, delta=delta))

    def end(self, arguments: str) -> None:
        if "".join(self._parts) != arguments:
            raise AssertionError("tool-call deltas do not add up to the arguments")
        self._events.append(ToolCallEnd(index=self._index, arguments=arguments))
        self.completed += 1


class _StopFilter:
    """Cuts the stream at the first end-of-turn marker, holding back a possible marker prefix."""

    def __init__(self, markers: Sequence[str]) -> None:
        self._markers = tuple(m for m in markers if m)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._markers:
            return text
        buf = self._held + text
        at, marker = find_earliest(buf, self._markers)
        if marker is not None:
            self.stopped, self._held = True, ""
            return buf[:at]
        cut = len(buf) - partial_suffix(buf, self._markers)
        self._held = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


_PREAMBLE, _REASONING, _CONTENT, _TOOL, _RAW, _DROP = range(6)


class StreamParser:
    def __init__(self, spec: ParserSpec, *, id_factory: Callable[[], str] | None = None) -> None:
        self.spec = spec
        self._events: list[Event] = []
        self._calls = _Calls(self._events, id_factory or new_call_id, dict(spec.tool_aliases))
        self._stop = _StopFilter(spec.stop_markers)
        self._buf = ""
        self._space = "\n" if spec.v4_rules else None  # what boundary trimming removes (None: any)
        self._state = {
            "reasoning": _REASONING,
            "maybe_reasoning": _PREAMBLE,
            "content": _CONTENT,
            "tool": _CONTENT,
        }[spec.initial]
        self._skip_space = self._state == _REASONING
        self._at_start = True  # no visible text yet: a Llama call may still open the reply
        self._open_markers = OPEN_MARKERS[spec.tool_format] if spec.tool_format else ()
        self._block: ToolBlock | None = None
        self._block_raw = ""  # text of the current block since its start or its last complete call
        self._block_bare = False  # opened by Llama-3.1's bare `{` (no marker): maybe a JSON answer
        self._calls_before_block = 0  # calls started before the current block opened
        self._finished = False
        if spec.initial == "tool" and spec.tool_format in DSML_FORMATS:
            self._block, self._state = tools_dsml.DsmlBlock(), _TOOL  # the prompt opened the block
        self._handlers = {
            _PREAMBLE: self._preamble,
            _REASONING: self._reasoning,
            _CONTENT: self._content,
            _TOOL: self._tool,
            _RAW: self._raw,
            _DROP: self._drop,
        }
        self.reasoning_tokens = 0

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[Event]:
        """Parse the next piece of output; returns the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        was_reasoning = self._state == _REASONING
        self._buf += self._stop.push(text)
        self._drain(final=False)
        # A piece counts as reasoning when reasoning was going on as it began or as it ended.
        if was_reasoning or self._state == _REASONING:
            self.reasoning_tokens += len(token_ids)
        return self._take()

    def finish(
        self, reason: FinishReason = "stop", *, stop_sequence: str | None = None, message: str | None = None
    ) -> list[Event]:
        """Flush held-back text and close the stream with a Finish event."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._buf += self._stop.flush()
        if self._state == _CONTENT and self._open_markers:
            # The end cut an opening marker: that part of what is held back is markup, and the
            # whitespace before it goes as it goes before a whole marker.
            held = partial_suffix(self._buf, self._open_markers)
            if held:
                self._buf = self._buf[: len(self._buf) - held].rstrip(self._space)
        self._drain(final=True)
        self._finished = True
        if reason == "stop" and self._calls.completed:
            reason = "tool_calls"
        self._events.append(Finish(reason=reason, stop_sequence=stop_sequence, message=message))
        return self._take()

    def _take(self) -> list[Event]:
        events = list(self._events)
        self._events.clear()
        return events

    def _drain(self, final: bool) -> None:
        while self._handlers[self._state](final):
            pass

    # Each state handler consumes what it can and returns True when the state changed
    # (so another handler should run), False when it needs more text.

    def _preamble(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(THINK_OPEN):
            self._buf = rest[len(THINK_OPEN) :]
            self._state, self._skip_space = _REASONING, True
            return True
        if THINK_OPEN.startswith(rest) and not final:
            return False
        self._state = _CONTENT
        return True

    def _drop_leading_space(self) -> bool:
        """Drop whitespace owed to a boundary; False while only whitespace has arrived."""
        if self._skip_space:
            self._buf = self._buf.lstrip(self._space)
            if not self._buf:
                return False
            self._skip_space = False
        return True

    def _reasoning(self, final: bool) -> bool:
        if not self._drop_leading_space():
            return False
        segment = scan_until(self._buf, (THINK_CLOSE,), final=final, hold_space=True, space=self._space)
        text = segment.text.rstrip(self._space) if segment.marker is None and final else segment.text
        if text:
            self._events.append(ReasoningDelta(text))
        self._buf = self._buf[segment.consumed :]
        if segment.marker is None:
            return False
        self._state, self._skip_space = _CONTENT, True
        return True

    def _content(self, final: bool) -> bool:
        if not self._drop_leading_space():
            return False
        if self.spec.tool_format == "llama3_json" and self._at_start:
            rest = self._buf.lstrip()
            if not rest and not final:
                return False
            self._at_start = False
            if rest.startswith("{"):
                self._open_block(self._buf[: len(self._buf) - len(rest)])
                self._buf = rest
                return True
        segment = scan_until(
            self._buf,
            self._open_markers,
            final=final,
            hold_space=bool(self._open_markers),
            space=self._space,
        )
        if segment.text:
            self._events.append(TextDelta(segment.text))
            self._at_start = False
        if segment.marker is not None:
            dropped = self._buf[len(segment.text) : segment.consumed - len(segment.marker)]
            self._open_block(dropped + segment.marker)
        self._buf = self._buf[segment.consumed :]
        return segment.marker is not None

    def _open_block(self, raw: str) -> None:
        fmt = self.spec.tool_format
        if fmt in DSML_FORMATS:
            self._block = tools_dsml.DsmlBlock(
                opened_by=next(m for m in self._open_markers if raw.endswith(m))
            )
        elif fmt in ("deepseek_v31", "deepseek_r1"):
            self._block = tools_deepseek.DeepSeekToolBlock(r1=fmt == "deepseek_r1")
        elif fmt == "hermes":
            self._block = tools_json.HermesBlock()
        else:
            self._block = tools_json.LlamaJsonBlock(self.spec.tool_names)
        self._block_raw = raw
        self._block_bare = fmt == "llama3_json" and not raw.endswith(tools_json.PYTHON_TAG)
        self._calls_before_block = self._calls.started
        self._state = _TOOL

    def _tool(self, final: bool) -> bool:
        assert self._block is not None
        # Read as if more could come first: a block still waiting for text when the output
        # ends was cut there, which is not the same as malformed.
        used, status = self._block.step(self._buf, self._calls, False)
        cut = False
        if final and status is Status.MORE:
            _, status = self._block.step(self._buf[used:], self._calls, True)
            # What the block was still waiting on is markup the end cut (a half-written marker).
            used, cut = len(self._buf), status is Status.BAD
        self._block_raw += self._buf[:used]
        self._buf = self._buf[used:]
        if status is Status.MORE:
            return False
        if cut and (not self._block_bare or self._bare_call_begun()):
            self._block, self._block_raw = None, ""
            self._state = _DROP
        elif status is Status.CALL_DONE:
            self._block_raw = ""
        elif status is Status.BLOCK_DONE:
            self._block, self._block_raw = None, ""
            self._state, self._skip_space = (_DROP if self.spec.v4_rules else _CONTENT), True
        elif self.spec.tool_format in DSML_FORMATS:
            # Malformed or cut DSML is neither a call nor answer text: it is dropped, with the
            # rest of the output (the model's view of the turn is broken from here on).
            self._block, self._block_raw = None, ""
            self._state = _DROP
        else:  # malformed (or unfinished at the end): the block's text is plain text after all
            self._buf = self._block_raw + self._buf
            self._block, self._block_raw = None, ""
            self._state = _RAW
        return True

    def _bare_call_begun(self) -> bool:
        """Whether a bare Llama-3.1 block had begun a call: it started one, or its text so far
        is the head of one (`{"name": "` and an offered tool's name); otherwise it may be a JSON
        answer."""
        if self._calls.started > self._calls_before_block:
            return True
        compact = "".join(self._block_raw.split())
        return any(f'{{"name":"{name}"'.startswith(compact) for name in self.spec.tool_names)

    def _drop(self, final: bool) -> bool:
        self._buf = ""
        return False

    def _raw(self, final: bool) -> bool:
        if self._buf:
            self._events.append(TextDelta(self._buf))
            self._buf = ""
        return False
