"""What the API process holds while it serves: options, the engine client, the tokenizer and
recipe, the grammar validator, the response store, image workers and encoders; the key checks
made against its options.

What a request does with them (the edge pipeline) is server/pipeline.py and
server/engine_requests.py."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from deepinfer.config import ServerConfig
from deepinfer.frontend.client import EngineClient
from deepinfer.recipe import Recipe
from deepinfer.recipe.api.responses import ResponsesOptions
from deepinfer.recipe.api.responses_reasoning import ReasoningSealer
from deepinfer.server.auth import check_admin_key, check_api_key, is_admin
from deepinfer.server.constraints import GrammarValidator
from deepinfer.server.encoders import EncoderClient
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.stored_responses import StoredResponses
from deepinfer.tokenizer import Tokenizer


def state_of(request: Request) -> ServerState:
    """The server state the app was built with (server/app.py)."""
    return request.app.state.server


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    client: EngineClient
    tokenizer: Tokenizer
    recipe: Recipe | None
    recipe_error: str | None  # why there is no recipe (no chat template, ...)
    served_names: list[str]
    metrics: ServerMetrics
    created: int
    grammars: GrammarValidator | None = None  # built by start_state; needed by constrained requests
    draining: bool = False  # a graceful stop began: new requests get 503, those in flight finish
    reasoning_sealer: ReasoningSealer = field(default_factory=ReasoningSealer.generate)
    responses: StoredResponses = field(default_factory=lambda: StoredResponses(None))  # None: keeps nothing
    image_pool: ProcessPoolExecutor | None = None  # image preprocessing (a model with a vision tower)
    encoders: EncoderClient | None = None  # --encoder: image encoders that preprocess and encode images
    cluster_key: bytes | None = None  # --cluster-key-file: what peers prove they hold (server/peers.py)

    @property
    def responses_options(self) -> ResponsesOptions:
        return ResponsesOptions(hosted_tools=self.config.hosted_tools, reasoning=self.reasoning_sealer)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size

    # -- key checks against the options ------------------------------------------------------

    def authorize(self, request: Request) -> str | None:
        """The API key the client used; 401 when keys are required and it is missing or wrong."""
        return check_api_key(self.config.api_keys, request.headers)

    def authorize_admin(self, request: Request, what: str, alternative: str = "") -> None:
        """The admin routes' check (server/auth.py, shared with the router)."""
        check_admin_key(self.config.api_keys, self.config.admin_keys, request.headers, what, alternative)

    def is_admin(self, request: Request) -> bool:
        """Whether the request may see internal details (engine pid, why it died)."""
        return is_admin(self.config.api_keys, self.config.admin_keys, request.headers)
