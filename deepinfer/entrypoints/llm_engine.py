"""The in-process engine: text and validation around the engine core."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from deepinfer.config import EngineConfig
from deepinfer.engine.parallel.start import start_engine
from deepinfer.engine.protocol import Engine
from deepinfer.frontend.output_processor import OutputProcessor, SequenceDelta
from deepinfer.model.loader.load import LoadedModel
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest
from deepinfer.structured import GrammarSpec
from deepinfer.validation import check_prompt


@dataclass(slots=True)
class PreparedPrompt:
    prompt: str | None
    token_ids: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.core: Engine = start_engine(config, loaded)  # one core, or rank 0 of several ranks
        self.tokenizer = self.core.loaded.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def vocab_size(self) -> int:
        return self.core.loaded.config.vocab_size

    def prepare_prompt(self, prompt: str | list[int]) -> PreparedPrompt:
        if isinstance(prompt, str):
            return PreparedPrompt(prompt, self.tokenizer.encode(prompt))
        return PreparedPrompt(None, list(prompt))

    def validate(self, prompt: PreparedPrompt, params: SamplingParams) -> GrammarSpec | None:
        """Raise InvalidRequestError naming the bad field; nothing enters the engine. A structured
        output constraint is compiled here (and cached), so an unsupported schema fails now."""
        check_prompt(prompt.token_ids, self.vocab_size, self.core.max_model_len)
        params.validate(self.vocab_size)
        if params.structured_outputs is None:
            return None
        spec = GrammarSpec.from_structured_outputs(params.structured_outputs)
        self.core.validate_grammar(spec)
        return spec

    def enqueue(
        self,
        prompt: PreparedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        traffic_class: str | None = None,
        grammar: GrammarSpec | None = None,
    ) -> str:
        """Admit an already validated prompt (`grammar`: what validate returned)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        self.processor.add_request(request_id, prompt.prompt, prompt.token_ids, params)
        self.core.add_request(
            EngineRequest(
                request_id,
                prompt.token_ids,
                params,
                eos_token_ids=list(self.core.loaded.config.eos_token_ids),
                priority=priority,
                cache_salt=cache_salt,
                traffic_class=traffic_class,
                grammar=grammar,
            )
        )
        return request_id

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        traffic_class: str | None = None,
    ) -> str:
        """Validate and enqueue; raises InvalidRequestError before anything enters the engine."""
        prepared = self.prepare_prompt(prompt)
        grammar = self.validate(prepared, params)
        return self.enqueue(prepared, params, request_id, priority, cache_salt, traffic_class, grammar)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks are free and it produces no further output."""
        self.core.abort(request_id)
        self.processor.drop(request_id)

    def close(self) -> None:
        self.core.close()

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished() or self.core.has_work()

    def step_deltas(self) -> list[SequenceDelta]:
        deltas, stopped = self.processor.process(self.core.step())
        for request_id, index in stopped:
            self.core.abort(request_id, index)
        return deltas

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the current output of every request that advanced."""
        touched = dict.fromkeys(d.request_id for d in self.step_deltas())
        return [self.processor.request_output(request_id) for request_id in touched]
