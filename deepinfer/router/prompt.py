"""The router's view of a request: the prompt token ids the replicas will compute (rendered with
the same recipe and tokenizer they use), its cache salt and traffic class, and its session key.

A body the router cannot read is not the router's to reject: it goes to a replica, whose answer
(a 4xx naming the field) the client gets. So every failure here is "no features", never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.engine.kv_cache.prefix import extend_block_hashes, namespace_root, tenant_cache_salt
from deepinfer.model.loader.source import converted_gguf_dir, resolve_model_path
from deepinfer.recipe import ModelInfo, Recipe, RecipeError
from deepinfer.recipe.api import (
    chat_completion_to_conversation,
    messages_to_conversation,
    parse_completion_request,
    parse_responses_request,
    request_to_conversation,
)
from deepinfer.sampling_params import InvalidRequestError
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHAT, RESPONSES, MESSAGES, COMPLETIONS = (
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/completions",
)
GENERATING_PATHS = (CHAT, RESPONSES, MESSAGES, COMPLETIONS)
SESSION_HEADER = "x-session-id"


@dataclass(slots=True)
class PromptFeatures:
    token_ids: list[int]
    cache_salt: str | None
    traffic_class: str | None
    session_key: str | None
    _hashes: dict[tuple[str, int, str | None], list[bytes]] = field(default_factory=dict)

    def block_hashes(self, fingerprint: str, block_size: int, salt: str | None) -> list[bytes]:
        """The prefix hashes of every block an engine could reuse (the last token is always
        computed), as an engine of this fingerprint and block size computes them."""
        key = (fingerprint, block_size, salt)
        hashes = self._hashes.get(key)
        if hashes is None:
            hashes = []
            usable = (len(self.token_ids) - 1) // block_size * block_size
            extend_block_hashes(
                hashes, namespace_root(fingerprint, salt), self.token_ids[:usable], block_size
            )
            self._hashes[key] = hashes
        return hashes

    def salt_for(self, api_key: str | None, per_key: bool) -> str | None:
        """The salt a replica applies (one with API keys scopes it to the key, unless it runs
        with --shared-prefix-cache)."""
        if per_key and api_key:
            return tenant_cache_salt(api_key, self.cache_salt)
        return self.cache_salt


def session_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """OpenAI's prompt_cache_key, Anthropic's metadata.user_id, or an x-session-id header."""
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(metadata.get("user_id"), str):
        return str(metadata["user_id"])
    return headers.get(SESSION_HEADER)


class PromptRenderer:
    def __init__(self, recipe: Recipe | None, tokenizer: Tokenizer) -> None:
        self.recipe = recipe
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model: str | None, recipe_family: str | None) -> PromptRenderer:
        """The recipe and tokenizer of `model` (a GGUF is read from the conversion its replicas
        made on their first start)."""
        path = resolve_model_path(model)
        gguf = path.is_file() and path.suffix == ".gguf"
        tokenizer = Tokenizer.from_dir(converted_gguf_dir(path) if gguf else path)
        info = (
            ModelInfo.from_gguf(path, family=recipe_family)
            if gguf
            else ModelInfo.from_hf_dir(Path(path), family=recipe_family)
        )
        try:
            recipe: Recipe | None = Recipe.for_model(info)
        except RecipeError as error:
            log.warning("the router renders no chat prompts: %s", error)
            recipe = None
        if recipe is not None:
            recipe.warm(tokenizer.backend)
        return cls(recipe, tokenizer)

    def features(self, path: str, body: Any, headers: Mapping[str, str]) -> PromptFeatures | None:
        if not isinstance(body, Mapping):
            return None
        try:
            return self._features(path, body, headers)
        except (RecipeError, InvalidRequestError, ValueError, TypeError, KeyError):
            return None

    def _features(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> PromptFeatures | None:
        if path == COMPLETIONS:
            parsed = parse_completion_request(body)
            if len(parsed.prompts) != 1:
                return None  # several engine requests: no single prefix to route or hand off
            prompt = parsed.prompts[0]
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            return PromptFeatures(
                token_ids, parsed.cache_salt, parsed.traffic_class, session_key(body, headers)
            )
        if self.recipe is None:
            return None
        if path == CHAT:
            conv = chat_completion_to_conversation(body)
            kwargs = body.get("chat_template_kwargs")
        elif path == RESPONSES:
            conv = request_to_conversation(parse_responses_request(body))
            kwargs = None
        elif path == MESSAGES:
            conv = messages_to_conversation(body)
            kwargs = None
        else:
            return None
        rendered = self.recipe.render(
            conv,
            tokenizer=self.tokenizer.backend,
            template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )
        if not rendered.token_ids:
            return None
        return PromptFeatures(
            list(rendered.token_ids), conv.cache_salt, conv.traffic_class, session_key(body, headers)
        )
