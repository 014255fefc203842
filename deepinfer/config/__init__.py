"""One validated configuration: the engine's options (by sub-config) and the server's.

`deepinfer.config.flags` turns the fields into command-line flags; their help text lives on the
fields (`option(..., help=...)`), so the flags, the docs and the errors never disagree.
"""

from __future__ import annotations

from deepinfer.config.engine import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheConfig,
    DisaggregationConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StoreConfig,
)
from deepinfer.config.fields import ConfigError
from deepinfer.config.server import ServerConfig
from deepinfer.config.units import parse_int_list, parse_size

__all__ = [
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "CacheConfig",
    "ConfigError",
    "DisaggregationConfig",
    "EngineConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "StoreConfig",
    "parse_int_list",
    "parse_size",
]
