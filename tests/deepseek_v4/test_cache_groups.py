"""DeepSeek-V4's cache groups for the real V4-Flash and V4-Pro configs (deepinfer/bench/v4_kv_memory.py):
the layout the engine plans grows by exactly the formula's bytes per token, and holds a bounded
window per sequence in its sliding groups."""

from __future__ import annotations

import pytest
import torch

from deepinfer.bench.v4_kv_memory import FLASH_CONFIG, PRO_CONFIG, v4_bytes
from deepinfer.cache_layout import plan_cache_layout
from deepinfer.model.deepseek_v4.cache import CacheKind
from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.deepseek_v4.model import cache_declarations, v4_cache_groups


@pytest.mark.parametrize(
    ("config", "growth"), [(FLASH_CONFIG, 6880), (PRO_CONFIG, 9848)], ids=["v4-flash", "v4-pro"]
)
def test_planned_bytes_per_token_equal_the_formula(config, growth):
    arch = DeepseekV4Arch.from_raw(config)
    decls = [d for d in cache_declarations(arch) if d.layer < arch.num_layers]
    groups = v4_cache_groups(decls, torch.bfloat16, "target")
    assert sorted((g.kind, g.window or 0, g.tokens_per_entry) for g in groups) == [
        ("compressed", 0, 4),
        ("compressed", 0, 128),
        ("sliding", 8, 1),
        ("sliding", 128, 1),
    ]
    layout = plan_cache_layout(groups, 16, num_blocks=4096, max_num_seqs=1, max_num_batched_tokens=16)
    assert layout.bytes_per_token == growth
    million = 1 << 20
    kinds = v4_bytes(config, million, 2)
    assert layout.bytes_per_token * million == kinds[CacheKind.COMPRESSED_KV] + kinds[CacheKind.INDEXER_KEYS]
    # One sequence's sliding groups: its window's blocks, plus the planner's margin (a partial
    # block at each end and one step's 16 tokens), the same at any length.
    sliding = [g for g in layout.groups if g.group.kind == "sliding"]
    window_bytes = sum(
        v for k, v in kinds.items() if k not in (CacheKind.COMPRESSED_KV, CacheKind.INDEXER_KEYS)
    )
    held = sum(g.num_blocks * g.block_bytes for g in sliding)
    assert held == sum((-(-(g.group.window - 1) // 16) + 3) * g.block_bytes for g in sliding)
    assert window_bytes <= held
