"""Options of the HTTP side of `deepinfer serve`, validated where they are given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from deepinfer.config.fields import ConfigError, check_choice, check_positive, normalize_sizes, option
from deepinfer.recipe.images.fetch import FetchPolicy
from deepinfer.response_store.location import parse_response_store, parse_retention_overrides

LOG_LEVELS = ("debug", "info", "warning", "error")


def check_response_store(config: ServerConfig) -> None:
    """The response store's options parse (their errors name the option)."""
    if config.response_store is not None:
        try:
            parse_response_store(config.response_store)
        except ValueError as exc:
            raise ConfigError("response_store", str(exc)) from None
    if config.response_retention is not None:
        try:
            parse_retention_overrides(config.response_retention)
        except ValueError as exc:
            raise ConfigError("response_retention", str(exc)) from None
    check_positive("response_store_max_bytes", config.response_store_max_bytes, allow_none=False)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="0 picks a free port (printed at startup)")
    api_keys: Sequence[str] = option(
        default_factory=tuple,
        flag="--api-key",
        repeat=True,
        metavar="KEY",
        help="require this key (Authorization: Bearer or x-api-key); repeat for several",
    )
    served_model_names: Sequence[str] = option(
        default_factory=tuple,
        flag="--served-model-name",
        repeat=True,
        metavar="NAME",
        help="a name clients use in `model` (default: the model's); repeat for several",
    )
    max_waiting_requests: int = option(
        512, help="requests waiting for their first token before new ones get 429 (Anthropic: 529)"
    )
    max_body_bytes: int = option(32 << 20, size=True, help="larger request bodies get 413")
    default_max_tokens: int | None = option(
        None,
        help="output bound of a request that sets none (max_tokens, max_output_tokens); default: the "
        "chat encoding's, else the rest of the context. Agent clients such as Codex send no bound",
    )
    shared_prefix_cache: bool = option(
        False,
        help="share the prefix cache between API keys (by default each key has its own): repeated "
        "prompts get faster across tenants, but usage.cached_tokens and time to first token then tell "
        "one tenant what another sent (docs/security.md)",
    )
    admin_keys: Sequence[str] = option(
        default_factory=tuple,
        flag="--admin-key",
        repeat=True,
        metavar="KEY",
        help="the key of /metrics and /reset_prefix_cache (which every tenant shares); with API keys "
        "and no admin key, both are refused (see --public-metrics); repeat for several",
    )
    public_metrics: bool = option(
        False, help="serve /metrics without a key even when API or admin keys are set"
    )
    header_timeout: float = option(
        10.0, help="seconds a client may take to send a request's headers before it is disconnected"
    )
    stream_keepalive: float = option(
        5.0,
        help="seconds a stream may stay silent (a long prompt's prefill) before it sends a keep-alive: a "
        "Messages `ping` event (after `message_start`), an SSE comment on the OpenAI APIs. Clients with a "
        "stream idle timer (Claude Code, proxies) otherwise give up on a prefill of minutes",
    )
    image_max_pixels: int = option(
        4096 * 4096,
        help="images with more pixels (width x height, read from the header before decoding) get 400",
    )
    max_images_per_request: int = option(16, help="requests with more images get 400")
    recipe_family: str | None = option(
        None,
        flag=("--chat-encoding", "--recipe-family"),
        metavar="NAME",
        help="the chat encoding (prompt format and output parser), overriding the one detected from the "
        "model: deepseek_v41, deepseek_v4, deepseek_v32, deepseek_v31, deepseek_r1 or chat_template",
    )
    hosted_tools: Literal["drop", "reject"] = option(
        "drop",
        help="Responses tools the server cannot run (web_search, file_search, ...): drop them from the "
        "prompt, or answer 400",
    )
    json_schema_additional_properties: Literal["forbid", "allow"] = option(
        "forbid",
        help="object schemas of response formats and forced tool calls that declare properties but "
        "not additionalProperties: forbid other keys (OpenAI's strict semantics), or allow them",
    )
    reasoning_key: str | None = option(
        None,
        metavar="HEX",
        help="key for the Responses API's encrypted reasoning (64 hex digits); default: a new key at every "
        "start (blobs from before a restart then fail to decrypt)",
    )
    image_fetch: bool = option(
        False,
        help="fetch http(s) image URLs that requests give (off: images must come inline, as data URLs "
        "or base64); fetches go to public addresses only, within --image-fetch-timeout and the image size limit",
    )
    image_fetch_allow_private: bool = option(
        False,
        help="let image fetches reach loopback, private and link-local addresses (a trusted network only)",
    )
    image_fetch_timeout: float = option(10.0, help="seconds one image fetch may take, redirects included")
    image_workers: int = option(
        2, help="processes that decode and resize request images (a model with a vision tower only)"
    )
    engine_mode: Literal["process", "thread"] = option(
        "process", help="run the engine core in its own process (default) or on a thread of the server"
    )
    log_level: Literal["debug", "info", "warning", "error"] = option("info", help="log level")
    shutdown_timeout: float = option(
        30.0,
        help="seconds a graceful stop (SIGTERM, Ctrl-C) lets requests in flight finish, and then "
        "the engine flush queued KV-store writes",
    )

    response_store: str | None = option(
        None,
        help="where `store: true` Responses are kept: sqlite (a file in the cache directory), sqlite:PATH, "
        "redis://HOST:PORT[/DB] or off; default: the --kv-store's Redis when it is one, else sqlite",
    )
    response_retention: str | None = option(
        None,
        help="how long stored responses stay after their last use, per traffic class, e.g. chat=1d,agent=12h "
        "(default: the --kv-retention of each class)",
    )
    response_store_max_bytes: int = option(
        1 << 30, size=True, help="size cap of the response store; the least recently used go first"
    )

    def __post_init__(self) -> None:
        normalize_sizes(self)
        check_response_store(self)
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("port", f"expected 0..65535, got {self.port!r}")
        check_positive("max_waiting_requests", self.max_waiting_requests, allow_none=False)
        if isinstance(self.max_waiting_requests, float):
            raise ConfigError("max_waiting_requests", "must be an integer")
        check_positive("max_body_bytes", self.max_body_bytes, allow_none=False)
        check_positive("default_max_tokens", self.default_max_tokens)
        if isinstance(self.default_max_tokens, float):
            raise ConfigError("default_max_tokens", "must be an integer")
        check_positive("image_fetch_timeout", self.image_fetch_timeout, allow_none=False)
        check_positive("image_workers", self.image_workers, allow_none=False)
        if isinstance(self.image_workers, float):
            raise ConfigError("image_workers", "must be an integer")
        check_choice("engine_mode", self.engine_mode, ("process", "thread"))
        check_choice("log_level", self.log_level, LOG_LEVELS)
        check_choice("hosted_tools", self.hosted_tools, ("drop", "reject"))
        check_choice(
            "json_schema_additional_properties", self.json_schema_additional_properties, ("forbid", "allow")
        )
        if self.reasoning_key is not None:
            try:
                key = bytes.fromhex(self.reasoning_key)
            except ValueError:
                key = b""
            if len(key) != 32:
                raise ConfigError("reasoning_key", "expected 64 hex digits (an AES-256 key)")
        if (
            isinstance(self.shutdown_timeout, bool)
            or not isinstance(self.shutdown_timeout, int | float)
            or self.shutdown_timeout < 0
        ):
            raise ConfigError(
                "shutdown_timeout", f"must be a number of seconds >= 0, got {self.shutdown_timeout!r}"
            )
        if any(not key for key in self.api_keys):
            raise ConfigError("api_keys", "an API key must not be empty")
        object.__setattr__(self, "admin_keys", tuple(self.admin_keys))
        if any(not key for key in self.admin_keys):
            raise ConfigError("admin_keys", "an admin key must not be empty")
        if set(self.admin_keys) & set(self.api_keys):
            raise ConfigError("admin_keys", "an admin key must differ from every API key")
        check_positive("header_timeout", self.header_timeout, allow_none=False)
        check_positive("stream_keepalive", self.stream_keepalive, allow_none=False)
        for name in ("image_max_pixels", "max_images_per_request"):
            value = getattr(self, name)
            check_positive(name, value, allow_none=False)
            if isinstance(value, float):
                raise ConfigError(name, "must be an integer")

    @property
    def prefix_cache_per_key(self) -> bool:
        """Whether each API key gets its own prefix cache (the default once keys are set)."""
        return bool(self.api_keys) and not self.shared_prefix_cache

    def image_fetch_policy(self) -> FetchPolicy:
        return FetchPolicy(
            enabled=self.image_fetch,
            allow_private=self.image_fetch_allow_private,
            timeout_s=float(self.image_fetch_timeout),
        )
