"""deepinfer/bench/v41_kv_memory.py's formula against what the engine allocates: on the tiny V4.1 (a
scaled-down config through the real engine: its cache groups, bytes per token and windows, and
the Engram tables it maps) and on the script's assumed V4-Flash-sized configs (the layout the
engine plans for them)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.bench.v41_kv_memory import engram_host_bytes, growth_per_token, v41_bytes, v41_config
from deepinfer.cache_layout import plan_cache_layout
from deepinfer.model.deepseek_v4.cache import CacheKind
from deepinfer.model.deepseek_v4.engram import Engram
from deepinfer.model.deepseek_v4.model import v4_cache_groups
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_paged import cache_declarations
from tests.deepseek_v41.test_engine import _llm, checkpoint  # noqa: F401

LONG = 1 << 12  # tokens: past every window, a whole number of C2 pairs
GROWING = (CacheKind.COMPRESSED_KV, CacheKind.INDEXER_KEYS)


def test_the_engine_allocates_the_scripts_bytes_on_the_tiny_v41(checkpoint):  # noqa: F811
    """The engine keeps float32 (4 bytes a value) and int64 token ids: its bytes per token are the
    script's growth, and its sliding groups' windows hold exactly the script's fixed bytes."""
    llm = _llm(checkpoint, num_blocks=32)
    core = llm.engine.core
    kinds = v41_bytes(checkpoint.config, LONG, element_size=4)
    assert core.kv_bytes_per_token == growth_per_token(kinds, LONG)
    windows = [g.group for g in core.layout.groups if g.group.kind == "sliding"]
    assert sum(g.entry_bytes * (g.window - 1) for g in windows) == sum(
        v for k, v in kinds.items() if k not in GROWING
    )
    # The token ids are in there: a window of max_ngram_size - 1 int64 rows.
    ngram = checkpoint.config["text_config"]["engram_max_ngram_size"]
    assert kinds[CacheKind.TOKEN_IDS] == (ngram - 1) * 8
    tables = [m.table for m in core.loaded.model.modules() if isinstance(m, Engram)]
    assert len(tables) == len(checkpoint.config["text_config"]["engram_layer_ids"])
    rows, size = engram_host_bytes(checkpoint.config)
    assert rows == sum(t.weight.shape[0] for t in tables)
    assert size == sum(t.weight.nbytes + t.scale.nbytes for t in tables)
    llm.close()


@pytest.mark.parametrize(("sharing", "growth"), [("no sharing", 39680), ("YoCo sharing", 7680)])
def test_planned_bytes_per_token_equal_the_formula_at_flash_size(sharing, growth):
    """bf16 at V4-Flash's dimensions: C2 sources add (512 + 128) / 2 values a token, C1 sources
    512 + 128; the sliding groups are the raw KV window, the C2 state and the token ids."""
    config = v41_config(sharing)
    groups = v4_cache_groups(cache_declarations(DeepseekV41Arch.from_raw(config)), torch.bfloat16, "target")
    assert sorted((g.kind, g.window or 0, g.tokens_per_entry) for g in groups) == [
        ("compressed", 0, 2),
        ("full", 0, 1),
        ("sliding", 2, 1),
        ("sliding", 3, 1),
        ("sliding", 128, 1),
    ]
    layout = plan_cache_layout(groups, 16, num_blocks=4096, max_num_seqs=1, max_num_batched_tokens=16)
    million = 1 << 20
    assert layout.bytes_per_token == growth == growth_per_token(v41_bytes(config, million, 2), million)
