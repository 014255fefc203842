"""From a rendered conversation to engine requests, and from engine deltas to canonical events.

Shared by every generating route: they differ only in how they parse the body (the recipe's
API codecs) and which encoder turns events into their JSON and SSE (see answer.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from deepinfer.frontend.output_processor import SequenceDelta
from deepinfer.outputs import Logprob
from deepinfer.recipe import RenderedPrompt, StreamParser
from deepinfer.recipe.events import (
    Event,
    Finish,
    FinishReason,
    Logprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from deepinfer.recipe.family import PromptDefaults
from deepinfer.recipe.ir import GenerationParams, ResponseFormat
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.spec import GrammarSpec

_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def thinks(prompt: RenderedPrompt) -> bool:
    """Whether the model may write a thinking section before its answer to this prompt."""
    return prompt.parser_spec.initial in ("reasoning", "maybe_reasoning")


def grammar_for(
    response_format: ResponseFormat | None, param: str, *, thinks: bool, schema_param: str | None = None
) -> GrammarSpec | None:
    """The engine's constraint for a requested output format (None: free text). A model that may
    think first is constrained only after its thinking section. Errors name `param`, or
    `schema_param` (where the API puts a JSON schema) for a schema."""
    if response_format is None or response_format.type == "text":
        return None
    kind = response_format.type
    if kind == "json_object":
        spec = GrammarSpec.json_object(param=param)
    elif kind == "json_schema":
        spec = GrammarSpec.json(response_format.json_schema or {}, param=schema_param or param)
    elif kind == "regex":
        spec = GrammarSpec.regex(response_format.regex or "", param=param)
    elif kind == "choice":
        spec = GrammarSpec.choice(response_format.choices or [], param=param)
    else:
        spec = GrammarSpec.grammar(response_format.grammar or "", param=param)
    return spec.with_reasoning() if thinks else spec


def sampling_params(
    params: GenerationParams,
    *,
    max_tokens: int,
    skip_special_tokens: bool,
    defaults: PromptDefaults | None = None,
) -> SamplingParams:
    """The engine's parameters for a request; unset fields keep the engine's defaults, or the
    prompt encoding's (`defaults`: DeepSeek V4's thinking mode samples at temperature 1 with a
    top_p floor). `max_tokens` is the output bound the edge resolved (server/pipeline.py's
    output_bound: the one place that decides it)."""
    defaults = defaults or PromptDefaults()
    temperature = defaults.temperature if defaults.temperature is not None else params.temperature
    top_p = params.top_p
    if defaults.min_top_p is not None:
        top_p = max(top_p if top_p is not None else 1.0, defaults.min_top_p)
    optional: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }
    return SamplingParams(
        n=params.n,
        top_k=params.top_k or 0,
        seed=params.seed,
        stop=list(params.stop),
        max_tokens=max_tokens,
        min_tokens=params.min_tokens or 0,
        ignore_eos=params.ignore_eos,
        logprobs=(params.top_logprobs or 0) if params.logprobs else None,
        logit_bias=params.logit_bias,
        skip_special_tokens=skip_special_tokens,
        **{k: v for k, v in optional.items() if v is not None},
    )


def logprobs_event(entries: list[dict[int, Logprob]], top_k: int) -> Logprobs:
    """The recipe's Logprobs from the OutputProcessor's per-token dicts (sampled token first)."""
    tokens = []
    for entry in entries:
        items = list(entry.values())
        sampled = items[0]
        ranked = sorted((lp for lp in items if lp.rank is not None and lp.rank <= top_k), key=_rank)
        top = [TopLogprob(lp.decoded_token or "", lp.logprob) for lp in ranked]
        tokens.append(TokenLogprob(sampled.decoded_token or "", sampled.logprob, top=top))
    return Logprobs(tokens)


def _rank(logprob: Logprob) -> int:
    return logprob.rank or 0


class Choices(Protocol):
    """Turns deltas into (choice index, event) pairs; `fail` closes the open choices."""

    def events(self, delta: SequenceDelta) -> list[tuple[int, Event]]: ...

    def fail(self, message: str) -> list[tuple[int, Event]]: ...


class ChoiceParsers:
    """One StreamParser per choice, turning deltas into canonical events (Usage at the end)."""

    def __init__(self, prompt: RenderedPrompt, n: int, top_logprobs: int) -> None:
        self._parsers: list[StreamParser] = [prompt.new_parser() for _ in range(n)]
        self._finished = [False] * n
        self._top_logprobs = top_logprobs

    def events(self, delta: SequenceDelta) -> list[tuple[int, Event]]:
        index = delta.index
        parser = self._parsers[index]
        events: list[Event] = []
        if delta.logprobs:
            events.append(logprobs_event(delta.logprobs, self._top_logprobs))
        if delta.text or delta.token_ids:
            events.extend(parser.feed(delta.text, delta.token_ids))
        if delta.finish_reason is not None:
            self._finished[index] = True
            finish = finish_of(delta)
            events.extend(
                parser.finish(finish.reason, stop_sequence=finish.stop_sequence, message=finish.message)
            )
            events.append(usage_of(delta, parser.reasoning_tokens))
        return [(index, event) for event in events]

    def fail(self, message: str) -> list[tuple[int, Event]]:
        """An error Finish for every choice still open (the engine died under it)."""
        failed: list[tuple[int, Event]] = []
        for index, parser in enumerate(self._parsers):
            if not self._finished[index]:
                self._finished[index] = True
                failed.extend((index, e) for e in parser.finish("error", message=message))
        return failed


def usage_of(delta: SequenceDelta, reasoning_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=delta.num_output_tokens,
        cached_tokens=delta.num_cached_tokens,
        reasoning_tokens=reasoning_tokens,
    )


def finish_of(delta: SequenceDelta) -> Finish:
    """The canonical finish of a sequence; a stop string that matched is its stop sequence, an
    engine error (a grammar that failed to compile, ...) its message."""
    reason = _FINISH_REASONS.get(delta.finish_reason, "error")
    stop = delta.stop_reason if isinstance(delta.stop_reason, str) else None
    return Finish(reason, stop_sequence=stop, message=delta.error)
