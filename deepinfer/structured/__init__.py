"""Structured output: grammar specs, a compile service, matchers, and tool-call forcing.

Torch-free except `deepinfer.structured.bitmask` (imported by the runner only).

Engine flow:
    spec = GrammarSpec.from_structured_outputs(params.structured_outputs)   # 400 on bad shape
    handle = service.submit(spec)             # returns at once; compiles on a worker thread
    ... while not handle.done(): the request waits, the batch runs ...
    matcher = handle.new_matcher()            # GrammarCompileError (a 400) if it failed
    each step: backend.fill_bitmasks([(matcher, row), ...], bitmask)
               bitmask.apply_bitmask_(logits, bitmask_on_device, rows)
               matcher.accept_token(sampled)
"""

from __future__ import annotations

from deepinfer.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer.structured.errors import GrammarCompileError, GrammarError
from deepinfer.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceOptions
from deepinfer.structured.service import GrammarCompileService, GrammarHandle
from deepinfer.structured.spec import DEFAULT_REASONING_END, GrammarSpec
from deepinfer.structured.tokenizer_info import TokenizerInfo, bitmask_words
from deepinfer.structured.tool_calls import tool_call_spec

__all__ = [
    "DEFAULT_REASONING_END",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompileError",
    "GrammarCompileService",
    "GrammarError",
    "GrammarHandle",
    "GrammarMatcher",
    "GrammarSpec",
    "LLGuidanceBackend",
    "LLGuidanceOptions",
    "TokenizerInfo",
    "bitmask_words",
    "tool_call_spec",
]
