"""KV-cache manager and block pool alone: exact block ids, ref counts, eviction order."""

from __future__ import annotations

import pytest

from deepinfer.engine.kv_cache.block_pool import BlockPool
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import block_hash, namespace_root

from .helpers import ROOT, kv_manager, sequence


def admit(kv: KVCacheManager, seq, compute_all: bool = True):
    hits = kv.find_cached_prefix(seq)
    num_new = seq.num_tokens - hits.num_tokens
    assert kv.can_allocate(seq, num_new, hits)
    kv.allocate(seq, num_new, hits)
    if compute_all:
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_computed_blocks(seq)
    return hits


def test_fresh_allocation_takes_blocks_in_order():
    kv = kv_manager(num_blocks=8, block_size=4)
    seq = sequence(list(range(10)))
    admit(kv, seq)
    assert seq.block_table == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_common_prefix_shares_exact_blocks_and_partial_block_is_never_shared():
    kv = kv_manager(num_blocks=8, block_size=4)
    a = sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], seq_id=0)
    admit(kv, a)
    b = sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], seq_id=1)  # identical: the last (partial) block differs
    hits = admit(kv, b)
    assert hits.blocks == [[0, 1]]
    assert b.block_table == [0, 1, 3]  # block 2 (partial, tokens 9-10) is private to a
    assert [kv.groups[0].pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]


def test_last_token_is_always_computed():
    kv = kv_manager(num_blocks=8, block_size=4)
    admit(kv, sequence(list(range(8)), seq_id=0))
    again = sequence(list(range(8)), seq_id=1)  # exactly two full blocks
    hits = kv.find_cached_prefix(again)
    assert hits.blocks == [[0]]  # block 1 holds the last token, which must be recomputed for logits


def test_ref_counts_return_to_zero_and_blocks_stay_cached():
    kv = kv_manager(num_blocks=8, block_size=4)
    a, b = sequence(list(range(9)), 0), sequence(list(range(9)), 1)
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert all(block.ref_count == 0 for block in kv.groups[0].pool.blocks)
    assert kv.num_free_blocks == 8
    c = sequence(list(range(9)), 2)
    assert kv.find_cached_prefix(c).blocks == [[0, 1]]


def test_eviction_order_is_lru_with_chain_tail_first_and_unhashed_blocks_before_all():
    kv = kv_manager(num_blocks=8, block_size=4)
    a = sequence(list(range(100, 110)), 0)  # blocks 0, 1 full + 2 partial
    admit(kv, a)
    b = sequence(list(range(200, 209)), 1)  # blocks 3, 4 full + 5 partial
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    # Unhashed partial blocks first (most recently freed at the very head), then a's chain tail
    # to head, then b's chain tail to head; the never-used blocks 6, 7 sit where the pool started.
    assert kv.groups[0].pool.free_order() == [5, 2, 6, 7, 1, 0, 4, 3]
    evictions_before = kv.groups[0].pool.num_evictions
    for _ in range(5):
        kv.groups[0].pool.allocate()
    assert (
        kv.groups[0].pool.num_evictions - evictions_before == 1
    )  # block 1 (a's tail) evicted, a's head survives
    assert kv.find_cached_prefix(sequence(list(range(100, 110)), 2)).blocks == [[0]]


def test_revived_hits_count_against_free_blocks():
    kv = kv_manager(num_blocks=3, block_size=4)
    a = sequence(list(range(9)), 0)
    admit(kv, a)
    kv.free(a)
    b = sequence(list(range(9)), 1)
    hits = kv.find_cached_prefix(b)
    assert hits.blocks == [[0, 1]]
    assert kv.can_allocate(b, 1, hits)  # 2 revived + 1 new = 3 blocks
    c = sequence(list(range(13)), 2)
    hits_c = kv.find_cached_prefix(c)
    assert not kv.can_allocate(c, 13 - 8, hits_c)  # 2 revived + 2 new > 3 blocks


def test_copy_on_write_for_forked_partial_block():
    kv = kv_manager(num_blocks=8, block_size=4)
    parent = sequence(list(range(6)), 0)
    admit(kv, parent)
    child = sequence(list(range(6)), 1)
    kv.fork(parent, child)
    assert child.block_table == parent.block_table == [0, 1]
    kv.allocate(child, 1)
    assert child.block_table == [0, 2]  # private copy of the partial block
    assert kv.take_copies() == [(0, 1, 2)]  # (group, source, destination)
    assert kv.groups[0].pool.blocks[1].ref_count == 1 and kv.groups[0].pool.blocks[0].ref_count == 2


def test_prefix_caching_disabled_never_hits():
    kv = kv_manager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, sequence(list(range(9)), 0))
    assert kv.find_cached_prefix(sequence(list(range(9)), 1)).blocks == [[]]


def test_reset_only_when_idle():
    kv = kv_manager(num_blocks=8, block_size=4)
    a = sequence(list(range(9)), 0)
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(sequence(list(range(9)), 1)).blocks == [[]]


def test_double_free_is_an_error():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.release([block])
    with pytest.raises(RuntimeError):
        pool.release([block])


def test_hash_chain_depends_on_namespace_and_parent():
    salted = namespace_root("m", cache_salt="tenant-a")
    assert salted != namespace_root("m") != namespace_root("other-model")
    h1 = block_hash(ROOT, [1, 2, 3, 4])
    assert block_hash(ROOT, [1, 2, 3, 4]) == h1
    assert block_hash(salted, [1, 2, 3, 4]) != h1
    assert block_hash(h1, [1, 2, 3, 4]) != h1
