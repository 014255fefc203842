"""Output-side pieces shared by the three API encoders."""

from __future__ import annotations

import base64
import hashlib
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.recipe.events import Finish, Logprobs, Usage

FAILED = ("error", "abort")

# JSON has no infinities; a token the sampler ruled out gets the most negative finite value.
_LOGPROB_FLOOR = -9999.0


class GenerationError(RuntimeError):
    """A choice ended with `error`/`abort`: the server answers with the API's error body instead."""


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def failure_message(finish: Finish | None) -> str:
    if finish is None:
        return "generation ended without a finish reason"
    if finish.reason == "abort":
        return finish.message or "the request was aborted"
    return finish.message or "the engine failed while generating"


def merge_usage(usages: Iterable[Usage | None]) -> Usage | None:
    """One request's usage from its choices: the prompt is shared, completions add up."""
    known = [u for u in usages if u is not None]
    if not known:
        return None
    return Usage(
        prompt_tokens=max(u.prompt_tokens for u in known),
        completion_tokens=sum(u.completion_tokens for u in known),
        cached_tokens=max(u.cached_tokens for u in known),
        reasoning_tokens=sum(u.reasoning_tokens for u in known),
    )


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def _token_bytes(token: str, given: list[int] | None) -> list[int]:
    return given if given is not None else list(token.encode("utf-8"))


def logprob_entries(logprobs: Logprobs) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob objects (the same shape in Chat Completions and Responses)."""
    return [
        {
            "token": tok.token,
            "logprob": _finite(tok.logprob),
            "bytes": _token_bytes(tok.token, tok.bytes),
            "top_logprobs": [
                {
                    "token": top.token,
                    "logprob": _finite(top.logprob),
                    "bytes": _token_bytes(top.token, top.bytes),
                }
                for top in tok.top
            ],
        }
        for tok in logprobs.tokens
    ]


def thinking_signature(thinking: str) -> str:
    """A content digest in the signature slot of a thinking block.

    The engine has no secret to sign with; clients that require a non-empty signature to send
    thinking back still work, and the digest tells whether the text was altered in between.
    """
    return base64.b64encode(hashlib.sha256(thinking.encode("utf-8")).digest()).decode("ascii")


@dataclass(slots=True)
class ToolCallTrack:
    """One tool call being streamed: the argument text so far and whether the parser closed it."""

    id: str
    name: str
    parts: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def arguments(self) -> str:
        return "".join(self.parts)

    def append(self, delta: str) -> str:
        self.parts.append(delta)
        return delta

    def finish(self, arguments: str) -> str:
        """Close the call with its complete arguments; returns what is left to send.

        When the streamed deltas are not a prefix of the final text (a parser that rewrote
        them), the final text wins and nothing more can be sent incrementally.
        """
        streamed = self.arguments
        remainder = arguments[len(streamed) :] if arguments.startswith(streamed) else ""
        self.parts = [arguments]
        self.done = True
        return remainder
