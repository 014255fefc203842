"""OpenAI legacy Completions (POST /v1/completions): the codec. A body parses into raw prompts
and generation parameters (no chat template, no conversation); canonical events encode into
`text_completion` chunks (SSE) or the final body.

No output parsing: the text is the model's, cut at stop strings. Several prompts in one body
are generated separately; choice `i * n + j` is the j-th sample of prompt i, as OpenAI numbers
them. What runs the prompts (their token ids, the engine requests, engine deltas as events) is
the server's (server/completions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from deepinfer.recipe.api._output import FAILED, GenerationError, failure_message
from deepinfer.recipe.api._request import EngineExtensions, check_min_tokens
from deepinfer.recipe.api._validation import ApiModel, require, validate
from deepinfer.recipe.api.error_bodies import openai_error_body
from deepinfer.recipe.api.sse import SSE_DONE, SSE_KEEPALIVE, sse_frame
from deepinfer.recipe.events import Event, Finish, Logprobs, TextDelta, Usage
from deepinfer.recipe.ir import GenerationParams

Prompt = str | list[int]


class _StreamOptions(ApiModel):
    include_usage: bool | None = None


class CompletionRequest(EngineExtensions):
    """The request body of POST /v1/completions (fields the engine uses; others ignored)."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    user: str | None = None


@dataclass(slots=True)
class CompletionsBody:
    """A checked Completions body: its prompts (text or token ids) and what they share."""

    prompts: list[Prompt]
    params: GenerationParams
    stream: bool
    include_usage: bool
    cache_salt: str | None
    traffic_class: str | None


def parse_completion_request(body: Any) -> CompletionsBody:
    """The body checked (400 naming the field); the parameters as the other APIs' IR carries them."""
    request = validate(CompletionRequest, body)
    require(not request.echo, "is not supported", "echo")
    require(not request.suffix, "is not supported", "suffix")
    n = request.n or 1
    require(
        request.best_of is None or request.best_of == n, "must equal n (best_of is not supported)", "best_of"
    )
    prompts = _prompts(request.prompt)
    check_min_tokens(request.min_tokens, request.max_tokens)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    for j, sequence in enumerate(stop):
        require(sequence != "", "stop sequences must not be empty", f"stop[{j}]")
    bias = None
    if request.logit_bias is not None:
        bias = {}
        for key, value in request.logit_bias.items():
            require(key.isdigit(), "keys must be token ids", f"logit_bias.{key}")
            bias[int(key)] = value
    params = GenerationParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        n=n,
        stop=stop,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs,
        logit_bias=bias,
        **request.extension_params(),
    )
    stream = bool(request.stream)
    return CompletionsBody(
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=stream and bool(request.stream_options and request.stream_options.include_usage),
        cache_salt=request.cache_salt,
        traffic_class=request.traffic_class,
    )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    require(len(prompt) > 0, "must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    for i, p in enumerate(prompt):
        require(not isinstance(p, list) or len(p) > 0, "must not be empty", f"prompt[{i}]")
    return list(prompt)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    offset: int = 0  # characters so far, for text_offset
    logprobs: dict[str, list[Any]] | None = None
    unsent: dict[str, list[Any]] | None = None
    finish: Finish | None = None
    usage: Usage | None = None


def _empty_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class CompletionEncoder:
    """Events -> `text_completion` chunks (SSE) or the final `text_completion` body; `feed` takes
    the choice index an event belongs to (`prompt * n + sample`)."""

    def __init__(
        self,
        *,
        completion_id: str,
        model: str,
        created: int,
        num_choices: int,
        n: int,
        include_usage: bool,
        stream: bool,
    ) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self.n = n
        self.include_usage = include_usage
        self._stream = stream
        self._choices = [_Choice(i) for i in range(num_choices)]
        self._closed = False

    def _chunk(self, choice: _Choice, text: str, finish_reason: str | None = None) -> list[str]:
        if not self._stream:
            return []
        logprobs, choice.unsent = choice.unsent, None
        entry = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return [sse_frame(self._envelope([entry]))]

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or self.include_usage:
            body["usage"] = usage
        return body

    def keepalive(self) -> list[str]:
        return [SSE_KEEPALIVE] if self._stream else []

    def feed(self, index: int, event: Event) -> list[str]:
        choice = self._choices[index]
        if choice.finish is not None and not isinstance(event, Usage):
            return []
        if isinstance(event, Logprobs):
            self._logprobs(choice, event)
        elif isinstance(event, TextDelta):
            choice.text.append(event.text)
            return self._chunk(choice, event.text)
        elif isinstance(event, Finish):
            choice.finish = event
            if event.reason not in FAILED:
                return self._chunk(choice, "", event.reason)
        elif isinstance(event, Usage):
            choice.usage = event
        return []

    def _logprobs(self, choice: _Choice, event: Logprobs) -> None:
        if choice.logprobs is None:
            choice.logprobs = _empty_logprobs()
        if choice.unsent is None:
            choice.unsent = _empty_logprobs()
        for token in event.tokens:
            for target in (choice.logprobs, choice.unsent):
                target["tokens"].append(token.token)
                target["token_logprobs"].append(token.logprob)
                target["top_logprobs"].append({top.token: top.logprob for top in token.top})
                target["text_offset"].append(choice.offset)
            choice.offset += len(token.token)

    def _usage(self) -> dict[str, Any] | None:
        known = [c.usage for c in self._choices if c.usage is not None]
        if not known:
            return None
        # Choices of one prompt share it: count each prompt once.
        prompts: dict[int, Usage] = {}
        for choice in self._choices:
            if choice.usage is not None:
                prompts.setdefault(choice.index // self.n, choice.usage)
        prompt_tokens = sum(u.prompt_tokens for u in prompts.values())
        completion_tokens = sum(u.completion_tokens for u in known)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in prompts.values())},
        }

    def _failed(self) -> _Choice | None:
        return next((c for c in self._choices if c.finish is None or c.finish.reason in FAILED), None)

    def close(self) -> list[str]:
        if self._closed or not self._stream:
            self._closed = True
            return []
        self._closed = True
        failed = self._failed()
        frames = []
        if failed is not None:
            frames.append(sse_frame(openai_error_body(failure_message(failed.finish), status=500)))
        elif self.include_usage:
            frames.append(sse_frame(self._envelope([], self._usage())))
        frames.append(SSE_DONE)
        return frames

    def body(self) -> dict[str, Any]:
        failed = self._failed()
        if failed is not None:
            raise GenerationError(failure_message(failed.finish))
        choices = [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": c.logprobs,
                "finish_reason": c.finish.reason if c.finish else None,
            }
            for c in self._choices
        ]
        body = self._envelope(choices)
        body["usage"] = self._usage()
        return body
