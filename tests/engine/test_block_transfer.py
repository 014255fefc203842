"""KVCaches' block transfer (what the KV store, the host tier and PD handoffs move): whole blocks
as raw bytes, a group's tensors one after another in each block's row, read back byte for byte
and written into exactly the blocks named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.cache_layout import CacheGroup, CacheTensor, plan_cache_layout
from deepinfer.runner.kv_caches import KVCaches

BLOCK = 4


def _caches(scratch_block: bool) -> tuple[KVCaches, CacheGroup]:
    # Two tensors of different widths and dtypes in one group (a layer's K/V beside another's).
    group = CacheGroup(
        "full",
        (CacheTensor("kv0", (2, 3), "float16", 2), CacheTensor("kv1", (5,), "bfloat16", 2)),
    )
    layout = plan_cache_layout([group], BLOCK, num_blocks=8, max_num_seqs=1, max_num_batched_tokens=BLOCK)
    return KVCaches(layout, {"target": [group]}, torch.device("cpu"), scratch_block=scratch_block), group


@pytest.mark.parametrize("scratch_block", [False, True])
def test_blocks_round_trip_byte_for_byte_into_the_blocks_named(scratch_block: bool) -> None:
    caches, group = _caches(scratch_block)
    block_bytes = BLOCK * group.entry_bytes
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, (3, block_bytes), dtype=np.uint8)
    payload.setflags(write=False)  # store buffers are read-only
    ids = [5, 1, 6]
    caches.write_blocks(0, ids, payload)
    assert np.array_equal(caches.read_blocks(0, ids), payload)
    assert np.array_equal(caches.read_blocks(0, [6, 5]), payload[[2, 0]])
    # The row layout, tensor by tensor: block b's slots of kv0, then its slots of kv1.
    kv0, kv1 = caches.tensors[0]
    width0 = BLOCK * group.tensors[0].slot_bytes
    for row, block in zip(payload, ids):
        slots = slice(block * BLOCK, (block + 1) * BLOCK)
        assert bytes(kv0[slots].contiguous().view(torch.uint8).numpy().reshape(-1)) == bytes(row[:width0])
        assert bytes(kv1[slots].contiguous().view(torch.uint8).numpy().reshape(-1)) == bytes(row[width0:])
    # Nothing else was written.
    others = [b for b in range(kv0.shape[0] // BLOCK) if b not in ids]
    assert not caches.read_blocks(0, others).any()


def test_a_payload_of_another_shape_is_refused() -> None:
    caches, group = _caches(False)
    with pytest.raises(ValueError, match="does not fit"):
        caches.write_blocks(0, [1, 2], np.zeros((2, BLOCK * group.entry_bytes + 1), dtype=np.uint8))
