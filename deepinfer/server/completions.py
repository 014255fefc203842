"""OpenAI legacy Completions, the server's half: each prompt of a body as an engine request, the
engine's deltas as plain-text events, and the recipe's CompletionEncoder behind the EventSink
interface. The codec itself (body parsing, `text_completion` encoding) is
recipe/api/completions.py.
"""

from __future__ import annotations

import asyncio

from deepinfer.frontend.output_processor import SequenceDelta
from deepinfer.recipe.api.completions import CompletionEncoder, CompletionsBody, Prompt
from deepinfer.recipe.events import Event, Finish, TextDelta
from deepinfer.sequence import EngineRequest
from deepinfer.server.generation import finish_of, logprobs_event, usage_of
from deepinfer.server.pipeline import Call, sampling_params
from deepinfer.server.state import ServerState
from deepinfer.validation import PromptTooLong, check_context, check_prompt


async def completion_requests(
    call: Call, parsed: CompletionsBody, completion_id: str
) -> list[tuple[EngineRequest, str | None]]:
    """One engine request per prompt (with its text, when it came as text), not yet admitted;
    a single prompt's request id is the completion's, the i-th of several `{id}-{i}`."""
    state = call.state
    single = len(parsed.prompts) == 1
    requests: list[tuple[EngineRequest, str | None]] = []
    for i, prompt in enumerate(parsed.prompts):
        where = "prompt" if single else f"prompt[{i}]"
        token_ids = await asyncio.to_thread(_prompt_ids, state, prompt, where)
        params = sampling_params(state, parsed.params, len(token_ids), skip_special_tokens=True)
        engine_request = call.engine_request(
            completion_id if single else f"{completion_id}-{i}",
            token_ids,
            params,
            cache_salt=parsed.cache_salt,
            traffic_class=parsed.traffic_class,
        )
        requests.append((engine_request, prompt if isinstance(prompt, str) else None))
    return requests


def _prompt_ids(state: ServerState, prompt: Prompt, where: str) -> list[int]:
    """A Completions prompt's ids, checked (on a thread: a long one takes seconds either way)."""
    if isinstance(prompt, str):
        try:
            token_ids = state.tokenizer.encode(prompt, max_tokens=state.max_model_len - 1)
        except PromptTooLong as error:
            check_context(error.num_tokens, state.max_model_len, where)
            raise
    else:
        token_ids = prompt
    check_prompt(token_ids, state.vocab_size, state.max_model_len, where)
    return token_ids


class TextChoices:
    """Deltas of plain text generation as events, indexed `prompt * n + sample`."""

    def __init__(self, request_ids: list[str], n: int, top_logprobs: int) -> None:
        self._base = {request_id: i * n for i, request_id in enumerate(request_ids)}
        self._open = set(range(len(request_ids) * n))
        self._top_logprobs = top_logprobs

    def events(self, delta: SequenceDelta) -> list[tuple[int, Event]]:
        index = self._base[delta.request_id] + delta.index
        events: list[Event] = []
        if delta.logprobs:
            events.append(logprobs_event(delta.logprobs, self._top_logprobs))
        if delta.text:
            events.append(TextDelta(delta.text))
        if delta.finish_reason is not None:
            self._open.discard(index)
            events += [finish_of(delta), usage_of(delta)]
        return [(index, event) for event in events]

    def fail(self, message: str) -> list[tuple[int, Event]]:
        failed: list[tuple[int, Event]] = [(i, Finish("error", message=message)) for i in sorted(self._open)]
        self._open.clear()
        return failed


class CompletionSink(CompletionEncoder):
    """The recipe's encoder as an EventSink (its other methods already are): nothing goes out
    before the first token."""

    def opening(self) -> list[str]:
        return []

    def first_output(self, delta: SequenceDelta) -> list[str]:
        return []
