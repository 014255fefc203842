"""Prometheus metrics: request latencies and outcomes measured here, engine state from its stats.

Latency histograms and token counters are updated once per finished request, never per token.
Engine gauges (running, waiting, KV blocks, prefix cache) are read from the engine's latest
stats when /metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.engine.stats import EngineStats
from deepinfer.frontend.client import RequestRecord

PREFIX = "deepinfer_"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
# vLLM metric name -> our engine gauge (kv_cache_usage_perc is vLLM's current name for KV usage,
# gpu_cache_usage_perc the one older schedulers read; both are fractions, 1 = full)
VLLM_ALIASES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_ratio",
}


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], tuple[EngineStats | None, bool, int]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, healthy, api_waiting = self._snapshot()
        yield GaugeMetricFamily(
            PREFIX + "engine_healthy", "1 while the engine is running", value=int(healthy)
        )
        yield GaugeMetricFamily(
            PREFIX + "api_waiting_requests",
            "requests sent to the engine whose first token has not come back (the backpressure count)",
            value=api_waiting,
        )
        if stats is None:
            return
        used = stats.num_blocks - stats.num_free_blocks
        gauges = {
            "num_requests_running": ("sequences the engine is running", stats.num_running),
            "num_requests_waiting": ("sequences waiting in the engine's queue", stats.num_waiting),
            "kv_cache_usage_ratio": ("fraction of KV blocks in use", stats.kv_usage),
            "kv_cache_used_blocks": ("KV blocks referenced by a sequence", used),
            "kv_cache_total_blocks": ("KV blocks in the pool", stats.num_blocks),
            "prefix_cache_cached_blocks": ("blocks that hold a reusable prefix", stats.prefix_cached_blocks),
            "prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache / looked up",
                stats.prefix_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        # The same gauges under vLLM's names, which llm-d's scheduler (the Gateway API inference
        # extension) and other load-aware gateways read from a model server (docs/deployment.md).
        for alias, name in VLLM_ALIASES.items():
            doc, value = gauges[name]
            yield GaugeMetricFamily(alias, f"{doc} (vLLM's name for {PREFIX}{name})", value=value)
        counters = {
            "prefix_cache_queried_tokens": (
                "prompt tokens looked up in the prefix cache",
                stats.prefix_queried_tokens,
            ),
            "prefix_cache_hit_tokens": ("prompt tokens found in the prefix cache", stats.prefix_hit_tokens),
            "prefix_cache_evictions": ("cached blocks evicted for new content", stats.prefix_evictions),
            "num_preemptions": ("sequences preempted for lack of KV blocks", stats.num_preemptions),
            "images_encoded": (
                "images run through the vision tower (encoder-cache hits not counted)",
                stats.images_encoded,
            ),
            "kv_store_errors": ("KV store failures: unreachable, slow, refused", stats.kv_store_errors),
            "kv_store_corrupt_chunks": (
                "stored KV chunks found damaged (checksum, truncation) and deleted",
                stats.kv_store_corrupt_chunks,
            ),
            "kv_store_forged_chunks": (
                "stored KV chunks that failed the cluster key's authentication, deleted",
                stats.kv_store_forged_chunks,
            ),
            "kv_store_write_drops": (
                "KV chunks not written to the store: queue full, store failing, stopped",
                stats.kv_store_write_drops,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if stats.per_rank:
            yield from _per_rank(stats.per_rank)


def _per_rank(per_rank: list[EngineStats]) -> Iterator[Metric]:
    """Data parallelism: the engine gauges of every rank, labelled dp_rank."""
    gauges = {
        "dp_rank_num_requests_running": ("sequences running on the data-parallel rank", "num_running"),
        "dp_rank_num_requests_waiting": ("sequences waiting on the data-parallel rank", "num_waiting"),
        "dp_rank_kv_cache_usage_ratio": ("fraction of the data-parallel rank's KV blocks in use", "kv_usage"),
        "dp_rank_prefix_cache_hit_rate": (
            "prompt tokens served from the data-parallel rank's prefix cache / looked up",
            "prefix_hit_rate",
        ),
    }
    for name, (doc, attribute) in gauges.items():
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["dp_rank"])
        for rank, stats in enumerate(per_rank):
            family.add_metric([str(rank)], getattr(stats, attribute))
        yield family


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "time from arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "mean time between output tokens after the first, per request",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "time from arrival to the last token (or the abort)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "generated tokens of finished requests", registry=self.registry
        )
        self.outcomes = Counter(
            PREFIX + "requests",
            "engine requests by outcome: stop, length, abort (client gone), error (engine failure), "
            "rejected (overloaded)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)

    def attach_engine(self, snapshot: Callable[[], tuple[EngineStats | None, bool, int]]) -> None:
        self.registry.register(_EngineCollector(snapshot))

    def count_outcome(self, outcome: str) -> None:
        self.outcomes.labels(outcome).inc()

    def request_done(self, record: RequestRecord, outcome: str) -> None:
        self.count_outcome(outcome)
        self.prompt_tokens.inc(record.num_prompt_tokens)
        generated = record.num_output_tokens
        self.generation_tokens.inc(generated)
        end = record.finish_time
        if end is not None:
            self.e2e.observe(end - record.arrival)
        first = record.first_token_time
        if first is not None:
            self.ttft.observe(first - record.arrival)
            per_sequence = max(record.output_tokens.values(), default=0)
            if end is not None and per_sequence > 1:
                self.tpot.observe((end - first) / (per_sequence - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
