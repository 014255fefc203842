"""Options of `deepinfer router`, validated where they are given (flags come from the fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from deepinfer.config.fields import ConfigError, check_choice, check_positive, normalize_sizes, option
from deepinfer.config.server import LOG_LEVELS

POLICIES = ("round_robin", "least_load", "cache_aware", "least_work")


def _check_urls(name: str, urls: Sequence[str]) -> tuple[str, ...]:
    checked = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(name, f"expected an http(s) URL such as http://127.0.0.1:8001, got {url!r}")
        checked.append(url.rstrip("/"))
    if len(set(checked)) != len(checked):
        raise ConfigError(name, f"a replica is listed twice: {list(urls)}")
    return tuple(checked)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="0 picks a free port (printed at startup)")
    replicas: Sequence[str] = option(
        default_factory=tuple,
        flag="--replica",
        repeat=True,
        help="a replica serving every role (a plain `deepinfer serve`), by URL; repeat for several",
    )
    prefill: Sequence[str] = option(
        default_factory=tuple,
        repeat=True,
        help="a `deepinfer serve --role prefill` replica, by URL; repeat for several (with --decode)",
    )
    decode: Sequence[str] = option(
        default_factory=tuple,
        repeat=True,
        help="a `deepinfer serve --role decode` replica, by URL; repeat for several (with --prefill)",
    )
    policy: Literal["round_robin", "least_load", "cache_aware", "least_work"] = option(
        "cache_aware",
        help="round_robin; least_load (fewest requests running and waiting); cache_aware (the replica "
        "holding the longest prefix of the prompt, by tier, unless the load is unbalanced); least_work "
        "(the fewest prompt blocks left to compute plus request_cost_blocks per request already there)",
    )
    request_cost_blocks: float = option(
        16.0,
        help="least_work: what one request running or waiting on a replica costs a new one, in prompt "
        "blocks to compute",
    )
    cache_threshold: float = option(
        0.3, help="cache_aware: the least share of the prompt a replica must hold to be chosen for it"
    )
    spread_shared_prefixes: bool = option(
        True,
        help="cache_aware: a prompt whose cached prefix is only what other conversations also began "
        "with (a common system prompt) is placed by load like a new conversation, not gathered where "
        "that prefix is cached",
    )
    balance_abs_threshold: int = option(
        64, help="cache_aware: route by load alone when the busiest replica has this many more requests ..."
    )
    balance_rel_threshold: float = option(1.5, help="... and this many times the least busy one's load")
    host_credit: float = option(
        0.8, help="cache_aware: a block in a replica's host tier counts this much of a device hit"
    )
    store_credit: float = option(
        0.6,
        help="cache_aware: a block in the shared store counts this much of a device hit, on every "
        "replica reading that store",
    )
    health_interval: float = option(1.0, help="seconds between health checks of each replica")
    health_timeout: float = option(2.0, help="seconds a health check may take")
    unhealthy_after: int = option(2, help="failed health checks in a row that take a replica out")
    breaker_failures: int = option(
        3, help="request failures in a row (connection refused, 502-504) that open a replica's circuit"
    )
    breaker_cooldown: float = option(
        5.0, help="seconds an open circuit waits before letting one probe through"
    )
    retries: int = option(2, help="other replicas a request is tried on when one fails before its first byte")
    request_timeout: float = option(600.0, help="seconds a replica may take to answer a request")
    drain_timeout: float = option(30.0, help="seconds in-flight requests may take to finish on SIGTERM")
    max_body_bytes: int = option(32 << 20, size=True, help="larger request bodies get 413")
    api_keys: Sequence[str] = option(
        default_factory=tuple,
        flag="--api-key",
        repeat=True,
        metavar="KEY",
        help="the replicas' API keys: a request without one of them gets 401 here, before its body is "
        "read or its prompt tokenized (default: the replicas alone check keys); repeat for several",
    )
    admin_keys: Sequence[str] = option(
        default_factory=tuple,
        flag="--admin-key",
        repeat=True,
        metavar="KEY",
        help="the key of the router's operator routes: /metrics, /reset_prefix_cache (sent on to the "
        "replicas, which need the same key) and the replicas' addresses and state in /health; with "
        "API keys and no admin key they are refused (see --public-metrics); repeat for several",
    )
    public_metrics: bool = option(
        False, help="serve /metrics without a key even when API or admin keys are set"
    )
    model: str | None = option(
        None,
        flag="--model",
        help="the replicas' model, whose recipe and tokenizer the router renders prompts with for "
        "cache-aware routing and prefill/decode handoff (default: the embedded model)",
    )
    recipe_family: str | None = option(
        None,
        flag=("--chat-encoding", "--recipe-family"),
        metavar="NAME",
        help="override the detected chat encoding (as on the replicas)",
    )
    cluster_key_file: str | None = option(
        None,
        metavar="PATH",
        help="the replicas' --cluster-key-file: signs prefill/decode handoffs and authenticates to the "
        "replicas' KV events (required when they have one)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = option("info", help="log level")

    def __post_init__(self) -> None:
        normalize_sizes(self)
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if any(not key for key in self.api_keys):
            raise ConfigError("api_keys", "an API key must not be empty")
        object.__setattr__(self, "admin_keys", tuple(self.admin_keys))
        if any(not key for key in self.admin_keys):
            raise ConfigError("admin_keys", "an admin key must not be empty")
        if set(self.admin_keys) & set(self.api_keys):
            raise ConfigError("admin_keys", "an admin key must differ from every API key")
        object.__setattr__(self, "replicas", _check_urls("replicas", self.replicas))
        object.__setattr__(self, "prefill", _check_urls("prefill", self.prefill))
        object.__setattr__(self, "decode", _check_urls("decode", self.decode))
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("port", f"expected 0..65535, got {self.port!r}")
        if bool(self.prefill) != bool(self.decode):
            raise ConfigError(
                "prefill", "prefill/decode disaggregation needs both --prefill and --decode replicas"
            )
        if not self.replicas and not self.prefill:
            raise ConfigError("replicas", "give at least one --replica (or --prefill and --decode)")
        if self.replicas and self.prefill:
            raise ConfigError("replicas", "use either --replica or --prefill/--decode, not both")
        check_choice("policy", self.policy, POLICIES)
        check_choice("log_level", self.log_level, LOG_LEVELS)
        for name in ("cache_threshold", "host_credit", "store_credit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ConfigError(name, f"expected a number in [0, 1], got {value!r}")
        for name in (
            "health_interval",
            "health_timeout",
            "breaker_cooldown",
            "request_timeout",
            "drain_timeout",
        ):
            check_positive(name, getattr(self, name), allow_none=False)
        check_positive("balance_abs_threshold", self.balance_abs_threshold, allow_none=False)
        check_positive("balance_rel_threshold", self.balance_rel_threshold, allow_none=False)
        check_positive("request_cost_blocks", self.request_cost_blocks, allow_none=False)
        check_positive("unhealthy_after", self.unhealthy_after, allow_none=False)
        check_positive("breaker_failures", self.breaker_failures, allow_none=False)
        check_positive("max_body_bytes", self.max_body_bytes, allow_none=False)
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError("retries", f"expected an integer >= 0, got {self.retries!r}")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)
