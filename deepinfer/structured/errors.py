"""Errors of the structured-output layer, shaped so the server can answer them as a 400."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepinfer.sampling_params import InvalidRequestError

ErrorKind = Literal["invalid", "unsupported", "too_complex", "timeout"]

# llguidance messages can be long (grammar dumps); a client needs the first lines, not the dump.
_MAX_MESSAGE_CHARS = 600


@dataclass(slots=True, frozen=True)
class GrammarError:
    """Why a constraint cannot be enforced. `param` is the request field to blame."""

    kind: ErrorKind
    message: str
    param: str = "structured_outputs"

    def to_exception(self) -> GrammarCompileError:
        return GrammarCompileError(self)


class GrammarCompileError(InvalidRequestError):
    """Raised where a compile result is demanded and there is none: a bad or unenforceable request."""

    def __init__(self, error: GrammarError) -> None:
        super().__init__(error.message, param=error.param)
        self.error = error

    @property
    def kind(self) -> ErrorKind:
        return self.error.kind


def clip_message(message: str) -> str:
    message = message.strip()
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return message[: _MAX_MESSAGE_CHARS - 3] + "..."
