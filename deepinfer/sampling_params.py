"""Per-request sampling and stopping parameters, validated before a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """Bad input from a client. `param` names the offending field so APIs can report it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StructuredOutputs:
    """One constraint on the output; exactly one field is set."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kind(self) -> str:
        set_fields = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(set_fields) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; got {set_fields}",
                param="structured_outputs",
            )
        return set_fields[0]


@dataclass(slots=True)
class SamplingParams:
    """The vLLM-compatible surface. temperature == 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token plus the top k
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int, max_model_len: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {message}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be between 0 and 20, got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "stop strings must be non-empty strings")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise bad(
                    "stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )
        for token_id, bias in (self.logit_bias or {}).items():
            if not 0 <= int(token_id) < vocab_size:
                raise bad("logit_bias", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"bias for token {token_id} must be in [-100, 100], got {bias}")
        if self.structured_outputs is not None:
            self.structured_outputs.kind()
