"""What the engine core knows of a request: token ids and parameters, no text.

A request fans out into `n` sequences. The first sequence prefills the prompt; when its prefill
completes the others are forked from it and share the prompt's KV blocks (copy-on-write for the
partial last block).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from deepinfer.image_input import ImageInput
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.structured.backend import GrammarMatcher
    from deepinfer.structured.spec import GrammarSpec


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


class KVSource(msgspec.Struct, frozen=True, array_like=True):
    """Where a decode engine pulls a request's prompt KV from: the prefill engine's transfer
    listener (host:port) and the id the prefill engine holds the blocks under."""

    address: str
    transfer_id: str


@dataclass(slots=True)
class EngineRequest:
    """The unit the engine core accepts: token ids only (text lives on the API side)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = scheduled earlier (vLLM convention)
    cache_salt: str | None = None
    traffic_class: str | None = None
    grammar: GrammarSpec | None = None  # structured output / forced tool call constraint
    kv_handoff: str | None = None  # prefill role: hold the prompt's KV for a decoder under this id
    kv_source: KVSource | None = None  # decode role: pull the prompt's KV from a prefill engine
    images: list[ImageInput] = field(default_factory=list)  # in prompt order, each at its positions


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: EngineRequest
    index: int  # choice index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    prefix_root: bytes
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # One block table per cache group (the KV manager's order), and per group how many leading
    # blocks are already indexed in the prefix cache.
    block_tables: list[list[int]] = field(default_factory=list)
    num_registered: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix hashes of its full blocks
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    pending_forks: int = 0  # siblings to fork when this sequence's prefill completes
    num_pending: int = 0  # things to wait for before admission (a grammar, a KV load, images); 0 = ready
    num_stored_chunks: int = 0  # leading KV-store chunks known to be stored (or loaded from it)
    grammar: GrammarMatcher | None = None  # structured output state, once its grammar compiled
    # Async scheduling: tokens a step still in flight is sampling for this sequence. The next
    # step is planned as if they were there; they join token_ids when that step lands.
    num_placeholders: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def block_table(self) -> list[int]:
        """The first cache group's table: the only one of a single-group model."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority, then arrival, then choice index."""
        return (self.request.priority, self.request.arrival_time, self.seq_id)


# -- the stop rule ---------------------------------------------------------------------------------
# Every place that asks whether a sequence ends (the scheduler appending tokens, planning past the
# tokens in flight, reserving draft slots; the speculative decoder bounding its drafts) asks here.


def length_room(seq: Sequence, max_model_len: int) -> int:
    """New tokens `seq` may still take before a length limit (max_tokens, the context) ends it:
    0 or less once it has reached one. Placeholders of a step in flight are not counted."""
    room = max_model_len - seq.num_tokens
    max_tokens = seq.params.max_tokens
    return room if max_tokens is None else min(room, max_tokens - seq.num_output_tokens)


def draft_room(seq: Sequence, max_model_len: int) -> int:
    """Draft tokens one decode step of `seq` may verify: k drafts and the token sampled after
    them are k + 1 new tokens within max_tokens, and the last of them takes no KV position yet,
    so the context leaves room for one more than `length_room` counts."""
    return length_room(seq, max_model_len + 1) - 1


def stop_after(seq: Sequence, token: int, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Whether `seq` ends with `token`, its newest token (already appended): (finish reason, stop
    reason), or None when it runs on. EOS (unless ignore_eos) and the stop token ids end it only
    past min_tokens (the sampler masks them until then); a length limit ends it regardless."""
    params = seq.params
    may_stop = seq.num_output_tokens > params.min_tokens
    if may_stop and not params.ignore_eos and token in seq.request.eos_token_ids:
        return FinishReason.STOP, None
    if may_stop and token in params.stop_token_ids:
        return FinishReason.STOP, token
    if length_room(seq, max_model_len) <= 0:
        return FinishReason.LENGTH, None
    return None
