"""The checks every prompt passes before it reaches the engine, whoever sends it (the offline
`LLM`, the server's routes, `deepinfer generate`). Errors name the request field."""

from __future__ import annotations

from deepinfer.sampling_params import InvalidRequestError


class PromptTooLong(Exception):
    """A prompt has more tokens than its caller can use (past the context), counted without
    keeping its ids (see tokenizer.ids_within)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


def check_context(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """400 when the prompt leaves no room for even one generated token."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"{param}: the prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
            f"the model's context length of {max_model_len} tokens",
            param=param,
        )


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, param: str = "prompt") -> None:
    """A token-id prompt: not empty, integers inside the vocabulary, shorter than the context."""
    if not token_ids:
        raise InvalidRequestError(f"{param}: must not be empty", param=param)
    bad = next(
        (t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size),
        None,
    )
    if bad is not None:
        raise InvalidRequestError(
            f"{param}: token id {bad!r} is outside the vocabulary [0, {vocab_size})", param=param
        )
    check_context(len(token_ids), max_model_len, param)


def max_tokens_for(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The client's limit, capped by the context left after the prompt (the whole of it if unset)."""
    remaining = max_model_len - num_prompt_tokens
    return remaining if requested is None else min(requested, remaining)
