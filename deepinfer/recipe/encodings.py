"""The chat encodings: one record per way of writing a prompt and reading the reply.

Design
------
An `Encoding` holds everything the recipe varies by encoding: the renderer factory, the tool
syntaxes its parser may read (a native encoding speaks exactly one: this is what keeps a V3.2
prompt from ever being read with a V3.1 parser), the control-token spellings protected in client
text, its end-of-turn markers, its prompt defaults, the images a prompt carries (and the
placeholder they take), whether its token ids come from its markers only, and whether its
output follows DeepSeek V4's rules. `Recipe` (family.py) and the stream parser
(parse/stream.py) read these records instead of tables keyed by name; which encoding a
checkpoint gets is its model family's choice (`deepinfer.families`).

A renderer factory returns an `EncodingRenderer`, the one shape every encoding renders through:
the prompt text, the tool syntax the prompt asks for, whether the model may think, the parser's
initial state (when the prompt decides it) and the tool-name aliases the model writes.

`register_encoding` adds one (a family that speaks a new encoding registers it from its own
folder); the built-in ones are registered at the end of this module, in the order the command
line lists them. Torch-free, like the rest of the recipe; this module imports the renderers and
nothing from parse/ (the parser imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal, Protocol

from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, ImagePart, Tool
from deepinfer.recipe.render import deepseek_v4
from deepinfer.recipe.render.chat_template import END_OF_TURN_MARKERS, ChatTemplateRenderer
from deepinfer.recipe.render.deepseek_v4 import DeepSeekV4Renderer
from deepinfer.recipe.render.deepseek_v31 import EOS as DEEPSEEK_EOS
from deepinfer.recipe.render.deepseek_v31 import DeepSeekR1Renderer, DeepSeekV31Renderer
from deepinfer.recipe.render.deepseek_v32 import DeepSeekV32Renderer

ToolFormat = Literal["dsml", "dsml_v4", "dsml_v41", "deepseek_v31", "deepseek_r1", "hermes", "llama3_json"]
InitialState = Literal["content", "maybe_reasoning", "reasoning", "tool"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

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


@dataclass(slots=True, frozen=True)
class PromptDefaults:
    """What the encoding sets for generation: `max_tokens` when the request has none; forced
    `temperature` / a `top_p` floor (None: the request's value stands)."""

    max_tokens: int | None = None
    temperature: float | None = None
    min_top_p: float | None = None


@dataclass(slots=True, frozen=True)
class RendererInputs:
    """What a renderer factory may use: the model's chat template and special tokens, the clock
    templates read, and the tool syntax its model family names (None: the encoding's own)."""

    chat_template: str | None
    special_tokens: Mapping[str, Any] | None
    now: Callable[[], datetime]
    tool_format: ToolFormat | None = None


class EncodingRenderer(Protocol):
    """How the recipe renders with one encoding (stateless between calls)."""

    @property
    def tool_format(self) -> ToolFormat | None: ...  # the syntax offered tools are called in

    @property
    def can_think(self) -> bool: ...  # the model may open a `<think>` block

    def render(self, conv: Conversation, template_kwargs: Mapping[str, Any] | None) -> str: ...

    def initial_state(self, conv: Conversation) -> InitialState | None:
        """Where the reply starts (None: read from the end of the prompt)."""
        ...

    def tool_aliases(self, tools: Sequence[Tool]) -> tuple[tuple[str, str], ...]:
        """(name the model writes, tool name) where they differ."""
        ...


@dataclass(slots=True, frozen=True)
class Encoding:
    name: str
    # The tool syntaxes its parser may read; a native encoding's prompts ask for the first.
    tool_formats: tuple[ToolFormat, ...]
    make_renderer: Callable[[RendererInputs], EncodingRenderer]
    # The spellings client text may not carry, given the model's special tokens.
    markers: Callable[[Mapping[str, Any] | None], tuple[str, ...]]
    # End-of-turn texts, given the chat template and the special tokens.
    stop_markers: Callable[[str | None, Mapping[str, Any] | None], tuple[str, ...]]
    defaults: Callable[[Conversation], PromptDefaults] = lambda conv: PromptDefaults()
    images: Callable[[Conversation], list[ImagePart]] = lambda conv: []
    image_placeholder: str | None = None  # the token each image of a prompt takes
    strict_tokens: bool = False  # only its own markers become control tokens, strictly checked
    v4_rules: bool = False  # DeepSeek V4's output rules (stream.py's ParserSpec.v4_rules)


_ENCODINGS: dict[str, Encoding] = {}


def register_encoding(encoding: Encoding) -> Encoding:
    """Add `encoding` to the registry (mutates it); a ValueError when its name is taken."""
    if encoding.name in _ENCODINGS:
        raise ValueError(f"a chat encoding named {encoding.name!r} is registered already")
    _ENCODINGS[encoding.name] = encoding
    return encoding


def encoding_names() -> tuple[str, ...]:
    """The registered encodings' names, in registration order."""
    return tuple(_ENCODINGS)


def find_encoding(name: str) -> Encoding | None:
    return _ENCODINGS.get(name)


def get_encoding(name: str) -> Encoding:
    """The encoding called `name`; a RecipeError naming `family` for an unknown one."""
    encoding = _ENCODINGS.get(name)
    if encoding is None:
        raise RecipeError(f"unknown recipe family {name!r}; expected one of {encoding_names()}", "family")
    return encoding


# -- the built-in encodings' renderers ------------------------------------------------------------


class _TemplateRenderer:
    """The model's own Jinja template; its tool syntax and thinking are read from its source,
    unless the model family names the syntax."""

    def __init__(self, inputs: RendererInputs) -> None:
        if not inputs.chat_template:
            raise RecipeError("the chat_template family needs the model's chat template", "chat_template")
        self._inner = ChatTemplateRenderer(inputs.chat_template, inputs.special_tokens, now=inputs.now)
        if inputs.tool_format is not None:
            self._inner.features = replace(self._inner.features, tool_format=inputs.tool_format)

    @property
    def tool_format(self) -> ToolFormat | None:
        return self._inner.features.tool_format

    @property
    def can_think(self) -> bool:
        return self._inner.features.can_think

    def render(self, conv: Conversation, template_kwargs: Mapping[str, Any] | None) -> str:
        return self._inner.render(conv, template_kwargs=template_kwargs)

    def initial_state(self, conv: Conversation) -> InitialState | None:
        return None

    def tool_aliases(self, tools: Sequence[Tool]) -> tuple[tuple[str, str], ...]:
        return ()


class _V4Renderer:
    """DeepSeek V4 / V4.1: the prompt decides where the reply starts, tools go by shown names."""

    def __init__(self, version: deepseek_v4.Version, tool_format: ToolFormat) -> None:
        self._inner = DeepSeekV4Renderer(version)
        self.tool_format: ToolFormat | None = tool_format
        self.can_think = True

    def render(self, conv: Conversation, template_kwargs: Mapping[str, Any] | None) -> str:
        return self._inner.render(conv)

    def initial_state(self, conv: Conversation) -> InitialState | None:
        return self._inner.initial_state(conv)

    def tool_aliases(self, tools: Sequence[Tool]) -> tuple[tuple[str, str], ...]:
        return tuple(deepseek_v4.tool_aliases(list(tools), self._inner.version).items())


class _NativeRenderer:
    """DeepSeek V3.2 / V3.1 / R1: a fixed codec, one tool syntax."""

    def __init__(self, make: Callable[[], Any], tool_format: ToolFormat) -> None:
        self._make = make
        self.tool_format: ToolFormat | None = tool_format
        self.can_think = True

    def render(self, conv: Conversation, template_kwargs: Mapping[str, Any] | None) -> str:
        return self._make().render(conv)

    def initial_state(self, conv: Conversation) -> InitialState | None:
        return None

    def tool_aliases(self, tools: Sequence[Tool]) -> tuple[tuple[str, str], ...]:
        return ()


def _v3_markers(special_tokens: Mapping[str, Any] | None) -> tuple[str, ...]:
    named = [v for v in (special_tokens or {}).values() if isinstance(v, str)]
    return (*named, *END_OF_TURN_MARKERS, THINK_OPEN, THINK_CLOSE, *_DEEPSEEK_V3_MARKERS)


def _v4_markers(special_tokens: Mapping[str, Any] | None) -> tuple[str, ...]:
    return deepseek_v4.MARKERS


def _deepseek_stops(chat_template: str | None, special_tokens: Mapping[str, Any] | None) -> tuple[str, ...]:
    return (DEEPSEEK_EOS,)


def _template_stops(chat_template: str | None, special_tokens: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The template's EOS and the end-of-turn markers it writes."""
    eos = (special_tokens or {}).get("eos_token")
    markers = [m for m in END_OF_TURN_MARKERS if m in (chat_template or "")]
    return tuple(dict.fromkeys([*([eos] if isinstance(eos, str) and eos else []), *markers]))


def _v4_defaults(min_top_p: float) -> Callable[[Conversation], PromptDefaults]:
    """V4's generation defaults: its max_tokens by effort; thinking forces temperature 1 and a
    top_p floor (`min_top_p`)."""

    def defaults(conv: Conversation) -> PromptDefaults:
        thinking = deepseek_v4.thinking_enabled(conv)
        return PromptDefaults(
            max_tokens=deepseek_v4.default_max_tokens(conv),
            temperature=1.0 if thinking else None,
            min_top_p=min_top_p if thinking else None,
        )

    return defaults


def _native(name: str, fmt: ToolFormat, make: Callable[[], Any]) -> Encoding:
    return Encoding(
        name=name,
        tool_formats=(fmt,),
        make_renderer=lambda inputs: _NativeRenderer(make, fmt),
        markers=_v3_markers,
        stop_markers=_deepseek_stops,
    )


for _encoding in (
    Encoding(
        name="deepseek_v41",
        tool_formats=("dsml_v41",),
        make_renderer=lambda inputs: _V4Renderer("v41", "dsml_v41"),
        markers=_v4_markers,
        stop_markers=_deepseek_stops,
        defaults=_v4_defaults(min_top_p=0.95),
        images=deepseek_v4.images_of,
        image_placeholder=deepseek_v4.IMAGE,
        strict_tokens=True,
        v4_rules=True,
    ),
    Encoding(
        name="deepseek_v4",
        tool_formats=("dsml_v4",),
        make_renderer=lambda inputs: _V4Renderer("v4", "dsml_v4"),
        markers=_v4_markers,
        stop_markers=_deepseek_stops,
        defaults=_v4_defaults(min_top_p=1.0),
        strict_tokens=True,
        v4_rules=True,
    ),
    _native("deepseek_v32", "dsml", DeepSeekV32Renderer),
    _native("deepseek_v31", "deepseek_v31", DeepSeekV31Renderer),
    _native("deepseek_r1", "deepseek_r1", DeepSeekR1Renderer),
    Encoding(
        name="chat_template",
        tool_formats=("hermes", "llama3_json", "deepseek_v31", "deepseek_r1"),
        make_renderer=_TemplateRenderer,
        markers=_v3_markers,
        stop_markers=_template_stops,
    ),
):
    register_encoding(_encoding)
