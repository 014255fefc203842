"""Text scanning shared by the streaming parsers.

The rule that makes parsing independent of how the stream is chunked: a piece of text is
released only once no marker can still start inside it, so only a possible marker prefix
(and, where asked, trailing whitespace) is ever held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class Status(Enum):
    MORE = "more"  # everything decidable was consumed; waiting for more text
    CALL_DONE = "call_done"  # a tool call just ended validly; the block goes on
    BLOCK_DONE = "block_done"  # the tool block is closed; back to plain text
    BAD = "bad"  # malformed: the block falls back to text


class CallSink(Protocol):
    """Where tool blocks report calls (the stream parser turns these into events)."""

    def start(self, name: str) -> None: ...

    def args(self, delta: str) -> None: ...

    def end(self, arguments: str) -> None: ...


class ToolBlock(Protocol):
    """A parser for one tool block, fed the text that follows its opening marker."""

    def step(self, buf: str, sink: CallSink, final: bool) -> tuple[int, Status]:
        """Consume a prefix of `buf`; return how much and what happened. `final`: no more text comes."""
        ...


@dataclass(slots=True)
class Segment:
    text: str  # the text to release
    consumed: int  # characters of the buffer used up (text, dropped whitespace and the marker)
    marker: str | None  # the marker that ended the segment, if one did


def find_earliest(buf: str, markers: Sequence[str]) -> tuple[int, str | None]:
    best, found = len(buf), None
    for marker in markers:
        at = buf.find(marker, 0, best + len(marker))
        if at != -1 and at < best:
            best, found = at, marker
    return best, found


def partial_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `buf` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buf)), best, -1):
            if buf.endswith(marker[:size]):
                best = size
                break
    return best


def scan_until(
    buf: str, markers: Sequence[str], *, final: bool, hold_space: bool = False, space: str | None = None
) -> Segment:
    """Release text up to the first marker (or all that can no longer start one).

    With `hold_space`, trailing whitespace (the characters of `space`; None: any) is held back
    until something follows it, and dropped when a marker follows it. With `final`, everything
    is released.
    """
    at, marker = find_earliest(buf, markers)
    if marker is not None:
        text = buf[:at]
        return Segment(text.rstrip(space) if hold_space else text, at + len(marker), marker)
    if final:
        return Segment(buf, len(buf), None)
    cut = len(buf) - partial_suffix(buf, markers)
    if hold_space:
        cut = len(buf[:cut].rstrip(space))
    return Segment(buf[:cut], cut, None)


def expect(buf: str, literals: Sequence[str]) -> tuple[str | None, int, bool]:
    """Match one of `literals` after optional whitespace.

    Returns (literal, consumed, pending): the literal and the characters it used up on a match;
    otherwise (None, 0, True) while the text so far could still become one, else (None, 0, False).
    """
    rest = buf.lstrip()
    skipped = len(buf) - len(rest)
    for literal in literals:
        if rest.startswith(literal):
            return literal, skipped + len(literal), False
    return None, 0, any(literal.startswith(rest) for literal in literals)
