"""Messages from the engine core to whoever turns tokens into text (in process or over IPC)."""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Logprob of one sampled token and the top-k alternatives (ids best first)."""

    logprob: float
    rank: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class SequenceOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one sequence in one step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    error: str | None = None  # why the engine ended it (finish_reason "error"), e.g. a grammar failure


class KVHandoff(msgspec.Struct, array_like=True, omit_defaults=True):
    """A prefill engine's news that a request's prompt KV is ready for its decoder: leased for a
    direct pull, or written to the shared store. `error` says why there is none."""

    transfer_id: str
    num_blocks: int = 0
    num_tokens: int = 0
    error: str | None = None
