"""The offline API, with the same surface as vLLM's `LLM`."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from deepinfer.config import EngineConfig
from deepinfer.entrypoints.llm_engine import LLMEngine
from deepinfer.model.loader.load import LoadedModel
from deepinfer.model.loader.source import resolve_model_path
from deepinfer.outputs import RequestOutput
from deepinfer.recipe import ModelInfo, Recipe
from deepinfer.recipe.api import chat_completion_to_conversation
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer

PromptInput = str | list[int] | dict[str, Any]


def _normalize_prompt(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


class LLM:
    """`LLM()` serves the embedded default model (SmolLM2-135M-Instruct).

    `loaded` reuses weights already in memory (another engine's `engine.core.loaded`), so several
    engines with different options can share one copy of the model in a process.
    """

    def __init__(
        self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_args: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args), loaded)
        self._chat_recipe: Recipe | None = None
        # At interpreter exit (or when collected) queued KV-store writes are flushed too.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Flush queued KV-store writes and stop background threads; idempotent. Also done on
        leaving a `with LLM(...)` block and at interpreter exit."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine.core.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        cache_salt: str | list[str | None] | None = None,
        traffic_class: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists or {"prompt_token_ids": ...} dicts) to completion.

        Every prompt is validated before any enters the engine, so a bad one fails the call
        without leaving half a batch running.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = [_normalize_prompt(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        salts = cache_salt if isinstance(cache_salt, list) else [cache_salt] * len(prompts)
        prepared = [self.engine.prepare_prompt(p) for p in prompts]
        grammars = [self.engine.validate(p, sp) for p, sp in zip(prepared, params)]
        ids = [
            self.engine.enqueue(
                p,
                sp,
                priority=priority[i] if priority else 0,
                cache_salt=salts[i],
                traffic_class=traffic_class,
                grammar=grammars[i],
            )
            for i, (p, sp) in enumerate(zip(prepared, params))
        ]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to OpenAI-style conversations, rendered by the model's recipe
        (its chat template, or DeepSeek's native format) exactly as the server renders them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptInput] = [
            self.render_chat(conversation, tools, chat_template_kwargs) for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids of one OpenAI-style conversation, as the server renders it."""
        body = {"model": "offline", "messages": messages, **({"tools": tools} if tools else {})}
        rendered = self._recipe().render(
            chat_completion_to_conversation(body),
            tokenizer=self.engine.tokenizer.backend,
            template_kwargs=chat_template_kwargs,
        )
        return rendered.token_ids

    def _recipe(self) -> Recipe:
        if self._chat_recipe is None:
            path = resolve_model_path(self.engine.config.model)
            info = ModelInfo.from_gguf(path) if path.suffix == ".gguf" else ModelInfo.from_hf_dir(path)
            self._chat_recipe = Recipe.for_model(info)
        return self._chat_recipe

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in request_ids]
