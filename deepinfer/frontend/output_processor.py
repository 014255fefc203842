"""Token ids from the engine core -> text deltas and RequestOutputs: detokenization and stop strings.

This runs where the text lives (the API process, or in process for the offline API). A stop string
can complete several tokens after it starts, so while stop strings are set the last
(longest stop - 1) characters are held back from streamed text until they can no longer be part of
a match. A matched stop string ends the sequence; the caller aborts it in the engine core.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import msgspec

from deepinfer.engine.outputs import SequenceOutput, TokenLogprobs
from deepinfer.frontend.detokenizer import IncrementalDetokenizer
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence produced since the last delta: the unit of streaming."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None  # set with finish_reason "error": why the engine ended the sequence


@dataclass(slots=True)
class _SequenceState:
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput
    emitted: int = 0  # characters of detokenizer.text already released


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[int, _SequenceState] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(
            s.output.finished for s in self.sequences.values()
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._requests[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _state(self, request: _RequestState, index: int) -> _SequenceState:
        state = request.sequences.get(index)
        if state is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
            )
            output = CompletionOutput(index, logprobs=[] if request.params.logprobs is not None else None)
            state = request.sequences[index] = _SequenceState(detok, output)
        return state

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        result = []
        for token_id, entry in zip(token_ids, entries):
            position = {
                token_id: Logprob(entry.logprob, entry.rank, self.tokenizer.decode([token_id], False))
            }
            for rank, (alt, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
                position.setdefault(alt, Logprob(lp, rank, self.tokenizer.decode([alt], False)))
            result.append(position)
        return result

    def process(self, outputs: list[SequenceOutput]) -> tuple[list[SequenceDelta], list[tuple[str, int]]]:
        """Returns the deltas, and the (request id, choice index) of sequences that ended on a stop
        string: the engine core, which knows no text, must abort them."""
        deltas: list[SequenceDelta] = []
        to_abort: list[tuple[str, int]] = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue  # already finished here (stop string) or dropped
            request.num_cached_tokens = out.num_cached_tokens
            state = self._state(request, out.index)
            if state.output.finished:
                continue
            try:
                delta = self._advance(request, state, out)
            except Exception:
                # This sequence's text cannot be made: it ends with an error, nothing else does.
                log.exception("processing the output of %s failed", out.request_id)
                delta = self._failed(request, state, out, "internal error while detokenizing the output")
            deltas.append(delta)
            if delta.finish_reason is not None and out.finish_reason is None:
                to_abort.append((out.request_id, out.index))
        return deltas, to_abort

    def _advance(self, request: _RequestState, state: _SequenceState, out: SequenceOutput) -> SequenceDelta:
        params, output = request.params, state.output
        if params.stop and len(out.new_token_ids) > 1:
            out = _cut_after_stop_string(state.detokenizer, out, params.stop)
        output.token_ids.extend(out.new_token_ids)
        new_logprobs = None
        if out.logprobs is not None and output.logprobs is not None:
            new_logprobs = self._logprobs(out.new_token_ids, out.logprobs)
            output.logprobs.extend(new_logprobs)
            output.cumulative_logprob = (output.cumulative_logprob or 0.0) + sum(
                e.logprob for e in out.logprobs
            )

        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        to_decode = out.new_token_ids
        if (
            finish_reason == "stop"
            and not isinstance(stop_reason, str)
            and not params.include_stop_str_in_output
        ):
            to_decode = to_decode[:-1]  # the EOS / stop token itself is not part of the text
        detok = state.detokenizer
        before = len(detok.text)
        detok.add(to_decode)
        if finish_reason is not None:
            detok.flush()
        text = detok.text
        end = len(text)
        if params.stop:
            match = _find_stop(text, max(0, before - max(map(len, params.stop)) + 1), params.stop)
            if match is not None:
                position, stop = match
                end = position + len(stop) if params.include_stop_str_in_output else position
                finish_reason, stop_reason = "stop", stop
            elif finish_reason is None:
                end = max(state.emitted, len(text) - max(map(len, params.stop)) + 1)
        new_text = text[state.emitted : end]
        state.emitted = end
        output.text = text[:end] if finish_reason is not None else text[: state.emitted]
        if finish_reason is not None:
            output.finish_reason, output.stop_reason = finish_reason, stop_reason
        return SequenceDelta(
            request.request_id,
            out.index,
            new_text,
            out.new_token_ids,
            new_logprobs,
            finish_reason,
            stop_reason,
            out.num_prompt_tokens,
            request.num_cached_tokens,
            len(output.token_ids),
            out.error,
        )

    @staticmethod
    def _failed(
        request: _RequestState, state: _SequenceState, out: SequenceOutput, error: str
    ) -> SequenceDelta:
        state.output.finish_reason = "error"
        return SequenceDelta(
            request.request_id,
            out.index,
            "",
            [],
            None,
            "error",
            None,
            out.num_prompt_tokens,
            request.num_cached_tokens,
            len(state.output.token_ids),
            error,
        )

    def request_output(self, request_id: str) -> RequestOutput:
        request = self._requests[request_id]
        outputs = [self._state(request, i).output for i in range(request.params.n)]
        result = RequestOutput(
            request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            finished=request.finished,
            num_cached_tokens=request.num_cached_tokens,
        )
        if result.finished:
            del self._requests[request_id]
        return result


def _cut_after_stop_string(
    detokenizer: IncrementalDetokenizer, out: SequenceOutput, stops: list[str]
) -> SequenceOutput:
    """Several tokens in one step (speculative decoding): when a stop string completes before the
    last of them, drop the tokens after the one that completed it, as if generation had stopped
    there (the caller then finds the stop string and ends the sequence)."""
    probe = copy.copy(detokenizer)
    probe.token_ids = list(detokenizer.token_ids)
    longest = max(map(len, stops))
    for i, token in enumerate(out.new_token_ids[:-1]):
        before = len(probe.text)
        probe.add([token])
        if _find_stop(probe.text, max(0, before - longest + 1), stops) is not None:
            return msgspec.structs.replace(
                out,
                new_token_ids=out.new_token_ids[: i + 1],
                logprobs=None if out.logprobs is None else out.logprobs[: i + 1],
                finish_reason=None,
                stop_reason=None,
            )
    return out


def _find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string at or after `start`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop, start)
        if position != -1 and (best is None or position < best[0]):
            best = (position, stop)
    return best
