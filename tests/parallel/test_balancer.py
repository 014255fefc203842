"""Routing of requests over data-parallel ranks: least load, prefix-cache aware."""

from __future__ import annotations

from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.parallel.balancer import DataParallelBalancer

ROOT = namespace_root("model")


def test_least_loaded_rank_first():
    balancer = DataParallelBalancer(3, block_size=4, capacity_blocks=100)
    ranks = [balancer.choose(list(range(100 * i, 100 * i + 5)), ROOT) for i in range(6)]
    assert ranks == [0, 1, 2, 0, 1, 2]
    balancer.report(0, 10)
    balancer.report(1, 0)
    balancer.report(2, 3)
    assert balancer.choose([7, 7, 7], ROOT) == 1


def test_a_shared_prefix_goes_where_its_blocks_are():
    balancer = DataParallelBalancer(2, block_size=4, capacity_blocks=100)
    system = list(range(1000, 1016))  # four full blocks
    assert balancer.choose([*system, 1, 2], ROOT) == 0
    assert balancer.choose(list(range(50, 70)), ROOT) == 1  # no match: the other rank
    balancer.report(0, 3)
    balancer.report(1, 1)
    assert balancer.choose([*system, 3, 4, 5], ROOT) == 0  # busier, but it holds the blocks
    assert balancer.num_prefix_routed == 1
    # Another tenant's salt is another namespace: no match.
    assert balancer.choose([*system, 3], namespace_root("model", "tenant-b")) == 1


def test_a_prefix_hit_does_not_overload_a_rank():
    balancer = DataParallelBalancer(2, block_size=4, capacity_blocks=100, max_imbalance=2)
    system = list(range(16))
    balancer.choose(system, ROOT)
    balancer.report(0, 5)
    balancer.report(1, 0)
    assert balancer.choose([*system, 99], ROOT) == 1


def test_remembered_blocks_are_bounded_and_reset():
    balancer = DataParallelBalancer(2, block_size=2, capacity_blocks=4)
    balancer.choose(list(range(20)), ROOT)
    assert len(balancer.cached[0]) == 4
    balancer.forget()
    assert not balancer.cached[0]
