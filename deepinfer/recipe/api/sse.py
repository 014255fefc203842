"""Server-sent event framing shared by the three APIs."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = "data: [DONE]\n\n"
# A comment line: SSE parsers (the OpenAI SDKs, Codex's) skip it; it only keeps the stream alive.
SSE_KEEPALIVE = ": keep-alive\n\n"


def to_json(payload: Any) -> str:
    # Compact and UTF-8 as-is: frames are sent per token, so every byte counts.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse_frame(payload: Any, event: str | None = None) -> str:
    """One SSE frame: `data: {json}\\n\\n`, preceded by `event: X` when the API names its events."""
    data = payload if isinstance(payload, str) else to_json(payload)
    if event is None:
        return f"data: {data}\n\n"
    return f"event: {event}\ndata: {data}\n\n"
