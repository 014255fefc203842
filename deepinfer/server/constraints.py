"""A chat request's output constraint (response format or forced tool call), checked before it
reaches the engine.

What a request may constrain, and how:
- `response_format` / `text.format` / `output_config.format`: the answer follows the schema.
- tool_choice `required` (Anthropic `any`) or a named tool (Anthropic `tool`): the answer is a
  well-formed call in the model's own tool-call syntax (the recipe's `tool_format`: Hermes
  `<tool_call>` JSON for Qwen-style and the default SmolLM2 templates, DSML for DeepSeek V3.2,
  V4 and V4.1)
  whose arguments follow that tool's schema. `auto` stays free; `none` renders no tools, so the
  parser reads any tool syntax as plain text.
- Both at once is a 400: a forced call is the whole answer, so there is no text left for the
  format to shape.
A model that may think first is constrained only after its thinking section (`</think>`).
An object schema (of a format or a forced call's arguments) that declares `properties` but not
`additionalProperties` allows no other key, as OpenAI's strict mode has it, unless the server
runs with `--json-schema-additional-properties allow` (JSON Schema's own reading).

The check compiles the grammar on the API side (the engine process compiles it again: grammars
do not cross the process boundary). Compiles run on the compile service's worker threads and are
awaited without blocking the event loop, so other requests keep streaming; repeats come from the
cache. An unsupported keyword, an invalid grammar or a compile timeout is a 400 before any
streaming starts, in the shape of the API the client speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from deepinfer.recipe import RenderedPrompt
from deepinfer.recipe.ir import Conversation
from deepinfer.recipe.parse.stream import THINK_CLOSE
from deepinfer.sampling_params import InvalidRequestError
from deepinfer.server.errors import ApiError
from deepinfer.server.generation import grammar_for, thinks
from deepinfer.structured import (
    GrammarCompileService,
    GrammarHandle,
    GrammarSpec,
    LLGuidanceBackend,
    LLGuidanceOptions,
    TokenizerInfo,
    tool_call_spec,
)
from deepinfer.structured.json_schema import closed_objects
from deepinfer.structured.tool_calls import forceable_tool_formats
from deepinfer.tokenizer import Tokenizer


@dataclass(slots=True, frozen=True)
class FormatField:
    """Where an API puts the output format, for error messages: the field and its schema."""

    name: str
    schema: str


CHAT_FORMAT = FormatField("response_format", "response_format.json_schema.schema")
RESPONSES_FORMAT = FormatField("text.format", "text.format.schema")
MESSAGES_FORMAT = FormatField("output_config.format", "output_config.format.schema")


def parallel_calls_allowed(body: Mapping[str, Any]) -> bool:
    """Whether a forced `required`/`any` choice may make several calls: OpenAI's
    `parallel_tool_calls` (default true), Anthropic's `tool_choice.disable_parallel_tool_use`."""
    if body.get("parallel_tool_calls") is False:
        return False
    choice = body.get("tool_choice")
    return not (isinstance(choice, Mapping) and choice.get("disable_parallel_tool_use") is True)


def output_constraint(
    conv: Conversation,
    prompt: RenderedPrompt,
    fmt: FormatField,
    *,
    parallel_calls: bool,
    special_tokens: frozenset[str],
    additional_properties: Literal["forbid", "allow"] = "forbid",
) -> GrammarSpec | None:
    """The engine's constraint for a chat request (None: free text); 400 for a bad combination."""
    choice = conv.tool_choice
    strict = additional_properties == "forbid"
    if choice.mode not in ("required", "named") or not conv.tools:
        spec = grammar_for(conv.response_format, fmt.name, thinks=thinks(prompt), schema_param=fmt.schema)
        if spec is not None and spec.kind == "json" and strict:
            spec = replace(spec, schema=closed_objects(spec.schema))
        return spec
    forced = "a named tool" if choice.mode == "named" else f"{choice.mode!r}"
    if conv.response_format is not None and conv.response_format.type != "text":
        raise InvalidRequestError(
            f"{fmt.name}: cannot be combined with tool_choice {forced}: a forced tool call is the "
            "whole answer, so there is no text for the format to shape; use tool_choice 'auto', "
            "or drop the format and constrain the call with the tool's parameters schema",
            param=fmt.name,
        )
    tool_format = prompt.parser_spec.tool_format
    # The syntaxes with a forced-call grammar (deepinfer.structured.tool_calls' table).
    forceable = forceable_tool_formats()
    if tool_format not in forceable:
        raise InvalidRequestError(
            f"tool_choice: forcing a tool call ({forced}) is not supported for this model's tool-call "
            f"syntax ({tool_format}); supported: {', '.join(forceable)}. Use tool_choice 'auto'",
            param="tool_choice",
        )
    tools = (
        [replace(t, parameters=closed_objects(t.parameters)) for t in conv.tools] if strict else conv.tools
    )
    return tool_call_spec(
        tools,
        tool_format,  # type: ignore[arg-type]
        name=choice.name if choice.mode == "named" else None,
        parallel=parallel_calls,
        special_tokens=special_tokens,
        after_reasoning=THINK_CLOSE if thinks(prompt) else None,
        opened=prompt.parser_spec.initial == "tool",  # the prompt wrote the block's opening
    )


class GrammarValidator:
    """The API process's compile service: same tokenizer view and backend as the engine's."""

    def __init__(self, service: GrammarCompileService) -> None:
        self.service = service

    @classmethod
    def build(cls, tokenizer: Tokenizer, model_vocab_size: int, timeout_s: float) -> GrammarValidator:
        """Blocking (builds llguidance's token trie); run it off the event loop."""
        info = TokenizerInfo.from_tokenizer(tokenizer, model_vocab_size)
        backend = LLGuidanceBackend(info, LLGuidanceOptions(mask_threads=0))  # compiles, never masks
        return cls(GrammarCompileService(backend, timeout_s=timeout_s))

    @property
    def special_tokens(self) -> frozenset[str]:
        return self.service.backend.tokenizer_info.special_tokens

    async def check(self, spec: GrammarSpec | None) -> None:
        """Return once `spec` compiles; an ApiError 400 naming the field if it cannot be enforced."""
        if spec is None:
            return
        handle = self.service.submit(spec)
        if not handle.done():
            await _done(handle)
        error = handle.error
        if error is not None:
            raise ApiError(400, error.message, param=error.param, code=f"grammar_{error.kind}")

    def close(self) -> None:
        self.service.close()


async def _done(handle: GrammarHandle) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def wake(_: GrammarHandle) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits any more
            loop.call_soon_threadsafe(_settle, future)

    handle.add_done_callback(wake)
    await future


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # the request may have been cancelled meanwhile
        future.set_result(None)
