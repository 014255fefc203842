"""The pairing facade: a model's metadata in, a Recipe that renders prompts and makes the
parser that matches each prompt out.

Families:
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

from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.events import FinishReason
from deepinfer.recipe.ir import Conversation, ImagePart, Message, TextPart
from deepinfer.recipe.model_info import ModelInfo
from deepinfer.recipe.parse.result import CompletionBuilder, ParsedCompletion
from deepinfer.recipe.parse.stream import (
    THINK_CLOSE,
    THINK_OPEN,
    InitialState,
    ParserSpec,
    StreamParser,
    ToolFormat,
)
from deepinfer.recipe.render import deepseek_v4
from deepinfer.recipe.render.chat_template import END_OF_TURN_MARKERS, ChatTemplateRenderer
from deepinfer.recipe.render.common import active_tools
from deepinfer.recipe.render.deepseek_v4 import DeepSeekV4Renderer
from deepinfer.recipe.render.deepseek_v31 import EOS as DEEPSEEK_EOS
from deepinfer.recipe.render.deepseek_v31 import DeepSeekR1Renderer, DeepSeekV31Renderer
from deepinfer.recipe.render.deepseek_v32 import DeepSeekV32Renderer
from deepinfer.recipe.tokens import SpecialTextGuard, added_token_spellings, prompt_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

FAMILIES = ("deepseek_v41", "deepseek_v4", "deepseek_v32", "deepseek_v31", "deepseek_r1", "chat_template")
V4_FAMILIES = ("deepseek_v4", "deepseek_v41")

_NATIVE_TOOL_FORMAT: dict[str, ToolFormat] = {
    "deepseek_v4": "dsml_v4",
    "deepseek_v41": "dsml_v41",
    "deepseek_v32": "dsml",
    "deepseek_v31": "deepseek_v31",
    "deepseek_r1": "deepseek_r1",
}
_DEEPSEEK_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "deepseek2")
# The control-token spellings of DeepSeek V3.x prompts, protected in client text even when no
# tokenizer is at hand.
_DEEPSEEK_V3_MARKERS = (
    "<｜begin▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "｜DSML｜",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)


def resolve_family(info: ModelInfo) -> str:
    """The recipe family for a model: the explicit one, else detected from its type and template."""
    if info.family is not None:
        if info.family not in FAMILIES:
            raise RecipeError(f"unknown recipe family {info.family!r}; expected one of {FAMILIES}", "family")
        return info.family
    model_type = (info.model_type or "").lower()
    template = info.chat_template
    if model_type == "deepseek_v4":
        return "deepseek_v4"
    if model_type.startswith("deepseek_v4"):
        return "deepseek_v41"  # deepseek_v41 and later V4-family configs: V4.1's encoding
    if model_type == "deepseek_v32":
        return "deepseek_v32"
    if model_type in _DEEPSEEK_MODEL_TYPES:
        if template is None:
            return "deepseek_v32"  # template-less DeepSeek checkpoints: V3.2's native encoding by default
        if "<｜tool▁sep｜>" in template and "```json" not in template and "thinking" in template:
            return "deepseek_v31"
        if "```json" in template and THINK_OPEN in template:
            return "deepseek_r1"
    if template is None:
        raise RecipeError(
            "the model has no chat template; set one or choose a recipe family", "chat_template"
        )
    return "chat_template"


@dataclass(slots=True, frozen=True)
class PromptDefaults:
    """What the encoding sets for generation: `max_tokens` when the request has none; forced
    `temperature` / a `top_p` floor (None: the request's value stands)."""

    max_tokens: int | None = None
    temperature: float | None = None
    min_top_p: float | None = None


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
    ) -> None:
        if family not in FAMILIES:
            raise RecipeError(f"unknown recipe family {family!r}; expected one of {FAMILIES}", "family")
        self.family = family
        self._template: ChatTemplateRenderer | None = None
        if family == "chat_template":
            if not chat_template:
                raise RecipeError("the chat_template family needs the model's chat template", "chat_template")
            self._template = ChatTemplateRenderer(chat_template, special_tokens, now=now)
            eos = (special_tokens or {}).get("eos_token")
            markers = [m for m in END_OF_TURN_MARKERS if m in chat_template]
            self._stop_markers = tuple(
                dict.fromkeys([*([eos] if isinstance(eos, str) and eos else []), *markers])
            )
        else:
            self._stop_markers = (DEEPSEEK_EOS,)
        self._v4 = (
            DeepSeekV4Renderer("v4" if family == "deepseek_v4" else "v41") if family in V4_FAMILIES else None
        )
        self._markers = self._family_markers(special_tokens)
        self._native = {
            "deepseek_v32": DeepSeekV32Renderer,
            "deepseek_v31": DeepSeekV31Renderer,
            "deepseek_r1": DeepSeekR1Renderer,
        }.get(family)

    def _family_markers(self, special_tokens: Mapping[str, Any] | None) -> tuple[str, ...]:
        if self.family in V4_FAMILIES:
            return deepseek_v4.MARKERS
        named = [v for v in (special_tokens or {}).values() if isinstance(v, str)]
        return (*named, *END_OF_TURN_MARKERS, THINK_OPEN, THINK_CLOSE, *_DEEPSEEK_V3_MARKERS)

    @classmethod
    def for_model(cls, info: ModelInfo, *, now: Callable[[], datetime] = datetime.now) -> Recipe:
        return cls(
            resolve_family(info),
            chat_template=info.chat_template,
            special_tokens=info.special_tokens,
            now=now,
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
        safe = guard.protect(conv)
        initial: InitialState | None = None
        if self._template is not None:
            rendered = self._template.render(safe, template_kwargs=template_kwargs)
            tool_format = self._template.features.tool_format
            can_think = self._template.features.can_think
        elif self._v4 is not None:
            rendered = self._v4.render(safe)
            tool_format = _NATIVE_TOOL_FORMAT[self.family]
            can_think = True
            initial = self._v4.initial_state(conv)
        else:
            assert self._native is not None
            rendered = self._native().render(safe)
            tool_format = _NATIVE_TOOL_FORMAT[self.family]
            can_think = True
        text = guard.restore(rendered)
        tools = active_tools(conv)
        if initial is None:
            tail = text.rstrip()
            if tail.endswith(THINK_OPEN):
                initial = "reasoning"
            elif can_think and not tail.endswith(THINK_CLOSE):
                initial = "maybe_reasoning"
            else:
                initial = "content"
        spec = ParserSpec(
            family=self.family,
            tool_format=tool_format if tools else None,
            initial=initial,
            stop_markers=self._stop_markers,
            tool_names=tuple(t.name for t in tools),
            tool_aliases=tuple(deepseek_v4.tool_aliases(tools, self._v4.version).items()) if self._v4 else (),
        )
        token_ids = None
        if tokenizer is not None:
            token_ids = prompt_tokenizer(tokenizer).encode(
                guard.segments(rendered), strict=self._v4 is not None, max_tokens=max_tokens
            )
        return RenderedPrompt(
            text=text,
            family=self.family,
            parser_spec=spec,
            token_ids=token_ids,
            images=deepseek_v4.images_of(conv) if self.family == "deepseek_v41" else [],
            defaults=self._defaults(conv),
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

    def _defaults(self, conv: Conversation) -> PromptDefaults:
        if self._v4 is None:
            return PromptDefaults()
        thinking = deepseek_v4.thinking_enabled(conv)
        return PromptDefaults(
            max_tokens=deepseek_v4.default_max_tokens(conv),
            temperature=1.0 if thinking else None,
            min_top_p=(0.95 if self.family == "deepseek_v41" else 1.0) if thinking else None,
        )

    def new_parser(
        self, prompt: RenderedPrompt, *, id_factory: Callable[[], str] | None = None
    ) -> StreamParser:
        """The parser for `prompt`; refuses a prompt rendered by another family."""
        if prompt.family != self.family or prompt.parser_spec.family != self.family:
            raise RecipeError(
                f"a {prompt.family} prompt cannot be parsed by the {self.family} recipe", param="family"
            )
        return prompt.new_parser(id_factory=id_factory)
