"""Streaming output parsers: model text in, canonical events out."""

from __future__ import annotations

from deepinfer.recipe.parse.result import CompletionBuilder, ParsedCompletion
from deepinfer.recipe.parse.stream import ParserSpec, StreamParser, new_call_id

__all__ = ["CompletionBuilder", "ParsedCompletion", "ParserSpec", "StreamParser", "new_call_id"]
