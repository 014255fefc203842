"""The router's Prometheus metrics: per-replica state and load, routing decisions and why, retries,
failures, prefill handoffs, and the cache hit rate the router expects from its index."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.router.index import PrefixIndex
from deepinfer.router.replica import Replica

PREFIX = "deepinfer_router_"


class _ReplicaCollector(Collector):
    def __init__(self, replicas: list[Replica], index: PrefixIndex, events_lost: Callable[[], int]) -> None:
        self._replicas = replicas
        self._index = index
        self._events_lost = events_lost

    def collect(self) -> Iterator[Metric]:
        labels = ["replica", "role"]
        families = {
            "replica_healthy": GaugeMetricFamily(
                PREFIX + "replica_healthy", "1 while in rotation", labels=labels
            ),
            "replica_breaker_state": GaugeMetricFamily(
                PREFIX + "replica_breaker_state", "circuit: 0 closed, 1 open, 2 half-open", labels=labels
            ),
            "replica_inflight": GaugeMetricFamily(
                PREFIX + "replica_inflight_requests",
                "requests this router has open on the replica",
                labels=labels,
            ),
            "replica_running": GaugeMetricFamily(
                PREFIX + "replica_engine_running",
                "sequences its engine runs (last health check)",
                labels=labels,
            ),
            "replica_waiting": GaugeMetricFamily(
                PREFIX + "replica_engine_waiting",
                "sequences waiting in its engine (last health check)",
                labels=labels,
            ),
        }
        indexed = GaugeMetricFamily(
            PREFIX + "index_blocks",
            "blocks the router believes the replica holds, by tier",
            labels=[*labels, "tier"],
        )
        for r in self._replicas:
            values = [r.url, r.role]
            families["replica_healthy"].add_metric(values, int(r.healthy))
            families["replica_breaker_state"].add_metric(values, int(r.breaker.state))
            families["replica_inflight"].add_metric(values, r.inflight)
            families["replica_running"].add_metric(values, r.engine_running)
            families["replica_waiting"].add_metric(values, r.engine_waiting)
            for tier, size in self._index.size(r.name).items():
                indexed.add_metric([*values, tier], size)
        yield from families.values()
        yield indexed
        yield CounterMetricFamily(
            PREFIX + "kv_event_gaps",
            "gaps in a replica's KV event sequence (its index was reset)",
            value=self._events_lost(),
        )


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "requests by outcome: ok (a replica answered), no_replica, client_gone, stream_error",
            ["outcome"],
            registry=self.registry,
        )
        self.decisions = Counter(
            PREFIX + "routing_decisions",
            "replicas chosen, by pool (both, prefill, decode) and reason (round_robin, load, balance, cache, affinity, work)",
            ["pool", "replica", "reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            PREFIX + "retries", "requests sent again to another replica", registry=self.registry
        )
        self.upstream_failures = Counter(
            PREFIX + "upstream_failures",
            "a replica that refused, reset, timed out or answered 502-504",
            ["replica"],
            registry=self.registry,
        )
        self.handoffs = Counter(
            PREFIX + "prefill_handoffs",
            "prefill/decode handoffs by outcome (ok, failed)",
            ["outcome"],
            registry=self.registry,
        )
        self.prompt_blocks = Counter(
            PREFIX + "prompt_blocks", "reusable prompt blocks of routed requests", registry=self.registry
        )
        self.credited_blocks = Counter(
            PREFIX + "credited_blocks",
            "of those, blocks the chosen replica was believed to hold (tier-weighted): over prompt_blocks, "
            "the expected prefix-cache hit rate",
            registry=self.registry,
        )
        self._prompt_blocks = 0
        self._credited_blocks = 0.0
        hit_rate = Gauge(
            PREFIX + "hit_rate_estimate",
            "credited_blocks / prompt_blocks: the prefix-cache hit rate routing expects",
            registry=self.registry,
        )
        hit_rate.set_function(
            lambda: self._credited_blocks / self._prompt_blocks if self._prompt_blocks else 0.0
        )

    def routed(self, pool: str, replica: str, reason: str, total_blocks: int, credit: float) -> None:
        self.decisions.labels(pool, replica, reason).inc()
        self.prompt_blocks.inc(total_blocks)
        self.credited_blocks.inc(credit)
        self._prompt_blocks += total_blocks
        self._credited_blocks += credit

    def watch(self, replicas: list[Replica], index: PrefixIndex, events_lost: Callable[[], int]) -> None:
        self.registry.register(_ReplicaCollector(replicas, index, events_lost))

    def render(self) -> bytes:
        return generate_latest(self.registry)
