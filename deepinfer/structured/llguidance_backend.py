"""The default grammar backend: llguidance (Earley parser + lazy lexer, masks in ~50 us).

Why llguidance: it refuses JSON Schema features it cannot enforce (`lenient` is forced off), so
a request gets a clear error instead of silently unconstrained output.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import llguidance

from deepinfer.structured.backend import GrammarMatcher, row_pointer
from deepinfer.structured.errors import GrammarError, clip_message
from deepinfer.structured.json_schema import BOUNDED_JSON_WHITESPACE, json_format_options, prepare_schema
from deepinfer.structured.lark import lark_string
from deepinfer.structured.mask_timing import MASK_TIMING
from deepinfer.structured.spec import GrammarSpec, canonical_schema
from deepinfer.structured.tokenizer_info import TokenizerInfo

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_TOO_COMPLEX = ("too large", "too big", "too complex", "limit", "panic")


@dataclass(slots=True, frozen=True)
class LLGuidanceOptions:
    """Server-wide settings. They override any `x-guidance` block a client puts in a schema."""

    whitespace_pattern: str = BOUNDED_JSON_WHITESPACE
    # Between the end of the thinking section and the constrained answer.
    reasoning_separator: str = r"[\x20\t\r\n]{1,4}"
    # Threads computing a step's masks: 0 computes them one after another on the calling thread
    # (CPU inference: the cores belong to the model, and a pool's threads spinning after their
    # work slow the model's next kernels down); None: llguidance's pool with its default size;
    # n: a pool of n threads (accelerator inference, where CPU cores are otherwise idle).
    mask_threads: int | None = None
    max_grammar_size: int | None = None  # llguidance default (500k symbols) when None
    initial_lexer_fuel: int | None = None

    def json_overrides(self) -> dict[str, Any]:
        return json_format_options(self.whitespace_pattern)

    def limits(self) -> llguidance.LLParserLimits:
        # verbose_errors off: error texts must not echo parser state or other requests' data.
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            verbose_errors=False,
        )


class LLGuidanceMatcher:
    """GrammarMatcher over an `llguidance.LLMatcher`."""

    __slots__ = ("_matcher", "_template")

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template
        self._matcher = template.deep_copy()

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._matcher

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        # In an error state llguidance allows only EOS, so a broken sequence ends instead of
        # sampling from an all -inf row.
        address, size = row_pointer(bitmask, row)
        self._matcher.unsafe_compute_mask_ptr(address, size)

    def accept_token(self, token_id: int) -> bool:
        start = time.perf_counter()
        accepted = self._matcher.consume_token(token_id)
        MASK_TIMING.accept_s += time.perf_counter() - start
        MASK_TIMING.tokens_accepted += 1
        return accepted

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self._matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def reset(self) -> None:
        # llguidance's reset() cannot leave an error state; a fresh copy always can.
        self._matcher = self._template.deep_copy()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None


@dataclass(slots=True, frozen=True)
class LLGuidanceGrammar:
    """A compiled grammar: the validated grammar text and a matcher at its start state to copy."""

    spec: GrammarSpec
    grammar: str
    template: llguidance.LLMatcher

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_info: TokenizerInfo, options: LLGuidanceOptions | None = None) -> None:
        self.options = options or LLGuidanceOptions()
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer_info.tokenizer_json,
            n_vocab=tokenizer_info.vocab_size,
            eos_token=list(tokenizer_info.eos_token_ids),
        )
        # llguidance treats more tokens as special than the tokenizer marks so: every added token
        # shaped like `<...>` (Qwen's `<tool_call>`, DeepSeek's `</think>`), whatever its flag. A
        # grammar must name those as tokens: spelled as text it would forbid the model's own token.
        special = _llguidance_special_tokens(tokenizer_info.tokenizer_json, self.ll_tokenizer)
        self.tokenizer_info = dataclasses.replace(
            tokenizer_info, special_tokens=special or tokenizer_info.special_tokens
        )
        threads = self.options.mask_threads
        self._executor = None if threads == 0 else llguidance.LLExecutor(num_threads=threads)

    @property
    def options_key(self) -> str:
        return f"{self.name}:{llguidance.__version__}:{self.options!r}"

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar | GrammarError:
        try:
            grammar = self.grammar_text(spec)
        except ValueError as e:  # llguidance's GBNF converter or JSON parsing refused the text
            what = "grammar" if spec.kind == "grammar" else spec.kind
            return GrammarError(
                "invalid", clip_message(f"{spec.param}: invalid {what}: {e}"), param=spec.param
            )
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.options.limits())
        if not matcher.is_error():
            # The first mask builds the lexer's initial state; pay for it here, off the engine step.
            matcher.compute_bitmask()
        if matcher.is_error():
            return translate_error(spec, matcher.get_error())
        return LLGuidanceGrammar(spec, grammar, matcher)

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], bitmask: Any) -> None:
        if not rows:
            return
        start = time.perf_counter()
        if self._executor is None:
            for matcher, row in rows:
                matcher.fill_bitmask(bitmask, row)
        else:
            words = int(bitmask.shape[1])
            base, _ = row_pointer(bitmask, 0)
            for _, row in rows:
                row_pointer(bitmask, row)  # bounds check before llguidance writes through raw pointers
            pairs = [(m.raw, row) for m, row in rows]  # type: ignore[attr-defined]
            self._executor.unsafe_compute_mask_ptr(pairs, base, words * 4, int(bitmask.shape[0]))
        MASK_TIMING.fill_s += time.perf_counter() - start
        MASK_TIMING.rows_filled += len(rows)

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar (a JSON `TopLevelGrammar` string) for a spec; ValueError if malformed."""
        if spec.kind in ("json", "json_object"):
            schema = prepare_schema(canonical_schema(spec.schema))  # type: ignore[arg-type]
            inner = llguidance.LLMatcher.grammar_from_json_schema(
                schema,
                overrides=self.options.json_overrides(),  # type: ignore[arg-type]
            )
        elif spec.kind == "regex":
            inner = llguidance.LLMatcher.grammar_from_regex(spec.text)  # type: ignore[arg-type]
        elif spec.kind == "choice":
            alternatives = " | ".join(lark_string(c) for c in spec.choices or ())
            inner = llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        else:
            inner = llguidance.grammar_from("grammar", spec.text)  # type: ignore[arg-type]
        if spec.after_reasoning:
            return self._after_reasoning(inner, spec.after_reasoning)
        return inner

    def _after_reasoning(self, inner: str, end_marker: str) -> str:
        """Free text up to the end marker, a short separator, then the inner grammar."""
        grammars = _grammar_list(inner)
        grammars[0]["name"] = "constrained_answer"
        if end_marker in self.tokenizer_info.special_tokens:
            # A special token never occurs inside text, so the thinking text needs no laziness.
            head = f"start: THINKING {end_marker} SEP? @constrained_answer\nTHINKING: /(?s:.*)/\n"
        else:
            suffix = lark_string(end_marker)
            head = f"start: thinking SEP? @constrained_answer\nthinking[suffix={suffix}]: /(?s:.*)/\n"
        head += f"SEP: /{self.options.reasoning_separator}/\n"
        return json.dumps({"grammars": [{"lark_grammar": head}, *grammars]})


def _llguidance_special_tokens(tokenizer_json: str, ll_tokenizer: llguidance.LLTokenizer) -> frozenset[str]:
    """The texts of the added tokens llguidance treats as special (matched by id, never as text)."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    return frozenset(
        token["content"]
        for token in added
        if 0 <= token["id"] < ll_tokenizer.vocab_size and ll_tokenizer.is_special_token(token["id"])
    )


def _grammar_list(grammar: str) -> list[dict[str, Any]]:
    """The sub-grammars of an llguidance grammar: a JSON `TopLevelGrammar` (what the JSON-schema
    and regex converters return) or plain Lark text (what the Lark and GBNF converters return)."""
    if grammar.lstrip().startswith("{"):  # a Lark grammar cannot start with "{"
        return json.loads(grammar)["grammars"]
    return [{"lark_grammar": grammar}]


def translate_error(spec: GrammarSpec, message: str) -> GrammarError:
    """An llguidance error as a client-facing message that names the offending keyword."""
    param = spec.param
    if m := _UNIMPLEMENTED.search(message):
        keys = [k.strip().strip('"') for k in m.group(1).split(",") if k.strip()]
        noun = "keyword" if len(keys) == 1 else "keywords"
        quoted = ", ".join(f"'{k}'" for k in keys)
        return GrammarError("unsupported", f"{param}: unsupported JSON Schema {noun} {quoted}", param)
    if m := _UNKNOWN_FORMAT.search(message):
        return GrammarError("unsupported", f"{param}: unsupported JSON Schema format '{m.group(1)}'", param)
    if "look-around" in message:
        return GrammarError(
            "unsupported", f"{param}: unsupported regex feature: look-ahead/look-behind assertions", param
        )
    if "supported" in message:  # "... not supported", "only supported when ..."
        return GrammarError(
            "unsupported", clip_message(f"{param}: unsupported JSON Schema use: {message}"), param
        )
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    if any(word in message for word in _TOO_COMPLEX):
        return GrammarError(
            "too_complex", clip_message(f"{param}: grammar too complex to enforce ({first_line})"), param
        )
    what = {"json": "JSON Schema", "json_object": "JSON Schema", "regex": "regex", "choice": "choice"}
    return GrammarError(
        "invalid", clip_message(f"{param}: invalid {what.get(spec.kind, 'grammar')}: {message}"), param
    )
