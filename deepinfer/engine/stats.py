"""What the engine reports of its load and prefix cache: plain data, read by the server's
metrics and the router without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    prefix_lookups: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_evictions: int
    prefix_cached_blocks: int
    num_preemptions: int
    # Images run through the vision tower (an encoder-cache hit does not count); 0 without one.
    images_encoded: int = 0
    # The KV store (counters since start; 0 without one): failures, chunks found damaged or
    # failing the cluster key's authentication (both deleted), writes dropped.
    kv_store_errors: int = 0
    kv_store_corrupt_chunks: int = 0
    kv_store_forged_chunks: int = 0
    kv_store_write_drops: int = 0
    # Data parallelism: the stats of every rank, in rank order (the fields above sum them).
    per_rank: list[EngineStats] = field(default_factory=list)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
