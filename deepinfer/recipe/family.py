"""The pairing facade: a model's metadata in, a Recipe that renders prompts and makes the
parser that matches each prompt out.

A recipe family is a chat encoding, one record each in deepinfer.recipe.encodings (renderer,
tool syntax, markers, defaults); which one a model gets is its model family's choice
(deepinfer.families), else the model's own chat template. The built-in families:
- deepseek_v4 / deepseek_v41: DeepSeek-V4 and V4.1's native encodings (DSML tool calls, effort
  levels, reminder turns), byte-exact with DeepSeek's own codec; V4.1 is the default for the V4
  family;
- deepseek_v32: DeepSeek-V3.2's native encoding (DSML tool calls);
- deepseek_v31: DeepSeek-V3.1 (hybrid thinking, special-token tool calls);
- deepseek_r1: DeepSeek-R1 (always thinks, fenced JSON tool calls);
- chat_template: the model's own Jinja template; the tool syntax is read from the template
  (Hermes `<tool_call>` for Qwen and for templates without tool support, Llama-3.1 JSON, …).

A parser is only ever made from a RenderedPrompt, which carries the family and the state its
prompt leaves the model in (thinking or not, tools offered or not).

Token ids come from deepinfer.recipe.tokens: only the renderer's own markers become control
tokens, for every family (client text that spells one is encoded as plain text).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from deepinfer.families import choose_encoding, family_for_model_type
from deepinfer.recipe.encodings import (
    THINK_CLOSE,
    THINK_OPEN,
    Encoding,
    InitialState,
    PromptDefaults,
    RendererInputs,
    ToolFormat,
    encoding_names,
    get_encoding,
)
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.events import FinishReason
from deepinfer.recipe.ir import Conversation, ImagePart, Message, TextPart
from deepinfer.recipe.model_info import ModelInfo
from deepinfer.recipe.parse.result import CompletionBuilder, ParsedCompletion
from deepinfer.recipe.parse.stream import ParserSpec, StreamParser
from deepinfer.recipe.render.common import active_tools
from deepinfer.recipe.tokens import SpecialTextGuard, added_token_spellings, prompt_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# The encodings registered as the recipe loads (the built-in ones; `register_encoding` adds
# more, which `encoding_names()` lists and this tuple does not).
FAMILIES = encoding_names()


def resolve_family(info: ModelInfo) -> str:
    """The recipe family for a model: the explicit one, else the one its model family chooses
    from its type and template, else its own chat template."""
    if info.family is not None:
        return get_encoding(info.family).name
    chosen = choose_encoding(info.model_type, info.chat_template)
    if chosen is not None:
        return chosen
    if info.chat_template is None:
        raise RecipeError(
            "the model has no chat template; set one or choose a recipe family", "chat_template"
        )
    return "chat_template"


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    family: str
    parser_spec: ParserSpec
    token_ids: list[int] | None = None
    images: list[ImagePart] = field(default_factory=list)  # in placeholder order, for the engine
    defaults: PromptDefaults = field(default_factory=PromptDefaults)

    def new_parser(self, *, id_factory: Callable[[], str] | None = None) -> StreamParser:
        """A streaming parser in the state this prompt leaves the model in."""
        return StreamParser(self.parser_spec, id_factory=id_factory)

    def parse_completion(
        self, text: str, *, finish_reason: FinishReason = "stop", id_factory: Callable[[], str] | None = None
    ) -> ParsedCompletion:
        """The final message for a whole completion of this prompt."""
        parser = self.new_parser(id_factory=id_factory)
        builder = CompletionBuilder()
        builder.extend(parser.feed(text))
        builder.extend(parser.finish(finish_reason))
        return builder.result()


def parse_completion(
    text: str,
    prompt: RenderedPrompt,
    *,
    finish_reason: FinishReason = "stop",
    id_factory: Callable[[], str] | None = None,
) -> ParsedCompletion:
    return prompt.parse_completion(text, finish_reason=finish_reason, id_factory=id_factory)


@lru_cache(maxsize=16)
def _guard_for(markers: tuple[str, ...], tokenizer: Tokenizer | None) -> SpecialTextGuard:
    specials = set(markers)
    if tokenizer is not None:
        specials.update(added_token_spellings(tokenizer))
    return SpecialTextGuard(specials)


class Recipe:
    """Renders conversations for one model and parses what it writes back."""

    def __init__(
        self,
        family: str,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, Any] | None = None,
        now: Callable[[], datetime] = datetime.now,
        tool_format: ToolFormat | None = None,
    ) -> None:
        """`family` names the encoding; `tool_format` is the syntax the model family names for
        its template (None: the encoding's own, or read from the template)."""
        self.encoding: Encoding = get_encoding(family)
        self.family = family
        if tool_format is not None and tool_format not in self.encoding.tool_formats:
            raise RecipeError(
                f"tool format {tool_format!r} does not belong to the {family} family", "tool_format"
            )
        self._renderer = self.encoding.make_renderer(
            RendererInputs(chat_template, special_tokens, now, tool_format)
        )
        self._stop_markers = self.encoding.stop_markers(chat_template, special_tokens)
        self._markers = self.encoding.markers(special_tokens)

    @classmethod
    def for_model(cls, info: ModelInfo, *, now: Callable[[], datetime] = datetime.now) -> Recipe:
        family = resolve_family(info)
        # The record's tool syntax is for the encoding it chose; an explicit family speaks its own.
        record = family_for_model_type(info.model_type) if info.family is None else None
        return cls(
            family,
            chat_template=info.chat_template,
            special_tokens=info.special_tokens,
            now=now,
            tool_format=record.tool_format if record is not None else None,  # type: ignore[arg-type]
        )

    def render(
        self,
        conv: Conversation,
        *,
        tokenizer: Tokenizer | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> RenderedPrompt:
        """The prompt for the next assistant turn; token ids too when a tokenizer is given
        (PromptTooLong instead past `max_tokens`).

        `template_kwargs` (chat_template_kwargs) only reach Jinja templates.
        """
        guard = self._guard(tokenizer)
        renderer = self._renderer
        rendered = renderer.render(guard.protect(conv), template_kwargs)
        text = guard.restore(rendered)
        tools = active_tools(conv)
        initial: InitialState | None = renderer.initial_state(conv)
        if initial is None:
            tail = text.rstrip()
            if tail.endswith(THINK_OPEN):
                initial = "reasoning"
            elif renderer.can_think and not tail.endswith(THINK_CLOSE):
                initial = "maybe_reasoning"
            else:
                initial = "content"
        spec = ParserSpec(
            family=self.family,
            tool_format=renderer.tool_format if tools else None,
            initial=initial,
            stop_markers=self._stop_markers,
            tool_names=tuple(t.name for t in tools),
            tool_aliases=renderer.tool_aliases(tools),
        )
        token_ids = None
        if tokenizer is not None:
            token_ids = prompt_tokenizer(tokenizer).encode(
                guard.segments(rendered), strict=self.encoding.strict_tokens, max_tokens=max_tokens
            )
        return RenderedPrompt(
            text=text,
            family=self.family,
            parser_spec=spec,
            token_ids=token_ids,
            images=self.encoding.images(conv),
            defaults=self.encoding.defaults(conv),
        )

    def warm(self, tokenizer: Tokenizer) -> None:
        """Render and tokenize a one-line conversation, so that the first request does not pay
        for compiling the template and building the prompt tokenizer: a server does it on a
        thread, but the build holds the GIL (and so its event loop) for 0.1-1 s. A recipe that
        cannot render a greeting says so on the requests that need it instead."""
        try:
            self.render(
                Conversation(messages=[Message(role="user", content=[TextPart("hi")])]), tokenizer=tokenizer
            )
        except RecipeError as error:
            log.warning("the chat template could not be warmed up: %s", error)

    def _guard(self, tokenizer: Tokenizer | None) -> SpecialTextGuard:
        """The spellings client text may not carry: the tokenizer's added tokens and the markers
        this family writes (so prompt text is the same with or without a tokenizer)."""
        return _guard_for(self._markers, tokenizer)

    def new_parser(
        self, prompt: RenderedPrompt, *, id_factory: Callable[[], str] | None = None
    ) -> StreamParser:
        """The parser for `prompt`; refuses a prompt rendered by another family."""
        if prompt.family != self.family or prompt.parser_spec.family != self.family:
            raise RecipeError(
                f"a {prompt.family} prompt cannot be parsed by the {self.family} recipe", param="family"
            )
        return prompt.new_parser(id_factory=id_factory)
