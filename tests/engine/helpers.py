"""Torch-free builders for scheduler and KV-manager unit tests."""

from __future__ import annotations

import itertools

from deepinfer.cache_layout import CacheGroup, CacheTensor, plan_cache_layout
from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence

ROOT = namespace_root("test-model")
_ids = itertools.count()


def request(
    tokens: list[int], max_tokens: int = 8, n: int = 1, priority: int = 0, arrival: float | None = None
):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
    req = EngineRequest(f"r{next(_ids)}", tokens, params, eos_token_ids=[0], priority=priority)
    if arrival is not None:
        req.arrival_time = arrival
    return req


def sequence(tokens: list[int], seq_id: int = 0) -> Sequence:
    req = request(tokens)
    return Sequence(seq_id, req, 0, list(tokens), len(tokens), ROOT)


TENSOR = CacheTensor("layers.0.kv", (2, 1, 4), "float32", 4)


def kv_manager(
    num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None
) -> KVCacheManager:
    """A KV manager over one cache group (full attention, or a sliding window) of `num_blocks`."""
    group = CacheGroup("full" if window is None else "sliding", (TENSOR,), window=window)
    return KVCacheManager(
        plan_cache_layout([group], block_size, num_blocks=num_blocks), enable_prefix_caching
    )


def make_scheduler(
    num_blocks: int = 16, block_size: int = 4, prefix: bool = True, max_model_len: int = 8192, **config
) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 2048)
    return Scheduler(SchedulerConfig(**config), max_model_len, kv_manager(num_blocks, block_size, prefix))


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule one step and pretend the model sampled `token` for every sampling sequence."""
    plan = scheduler.schedule()
    sampled = {}
    for item in plan.scheduled:
        if item.sample:
            for seq in (item.seq, *item.forks):
                sampled[seq.seq_id] = [token]
    return plan, scheduler.update(plan, sampled)
