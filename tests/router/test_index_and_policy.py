"""The router's prefix index (fed by KV events, credited by tier, a shared store credited to every
replica reading it) and the routing policies, on plain data."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deepinfer.config import ConfigError
from deepinfer.config.router import RouterConfig
from deepinfer.router.index import PrefixIndex, TierCredits
from deepinfer.router.policy import Candidate, Policy
from deepinfer.router.prompt import PromptFeatures
from deepinfer.transport.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

H = [bytes([i]) * 32 for i in range(10)]


def stored(hashes: list[bytes], medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, None, [], 16, None, medium)


def test_match_follows_the_chain_across_tiers_with_their_credit() -> None:
    index = PrefixIndex(TierCredits(device=1.0, host=0.5, store=0.25))
    index.add_replica("a", store="file:///kv")
    index.add_replica("b", store="file:///kv")
    index.apply("a", [stored(H[:2]), stored(H[2:4], "CPU"), stored(H[4:6], "STORE")])
    match = index.match("a", H[:8])
    assert (match.num_blocks, match.device_blocks) == (6, 2)
    assert match.credit == pytest.approx(2 + 2 * 0.5 + 2 * 0.25)
    # A store written through by one replica is a hit for every replica reading it.
    assert index.match("b", H[4:8]).credit == pytest.approx(0.5)
    assert index.match("b", H[:8]).num_blocks == 0  # but the chain starts at block 0


def test_removed_and_cleared_forget_blocks_but_never_the_store() -> None:
    index = PrefixIndex()
    index.add_replica("a", store="redis://h:6379/0")
    index.apply("a", [stored(H[:3]), stored(H[:3], "STORE")])
    index.apply("a", [BlockRemoved([H[1]], "GPU"), BlockRemoved([H[0]], "STORE")])
    assert index.match("a", H[:3]).device_blocks == 1
    index.apply("a", [AllBlocksCleared()])
    assert index.size("a") == {"GPU": 0, "CPU": 0, "STORE": 3}
    index.forget("a")
    assert index.match("a", H[:3]).num_blocks == 3  # from the store alone


@dataclass
class FakeReplica:
    name: str
    load: int = 0


def config(**options) -> RouterConfig:
    return RouterConfig(replicas=("http://a:1", "http://b:1"), **options)


def candidates(credits: list[float], loads: list[int], total: int = 10) -> list[Candidate]:
    from deepinfer.router.index import PrefixMatch

    return [
        Candidate(FakeReplica(f"r{i}", load), PrefixMatch(c, int(c), int(c)), total)
        for i, (c, load) in enumerate(zip(credits, loads))
    ]


def test_cache_aware_prefers_the_replica_holding_the_prompt() -> None:
    policy = Policy(config())
    decision = policy.choose(candidates([2.0, 8.0], [0, 5]), None)
    assert (decision.replica.name, decision.reason) == ("r1", "cache")


def test_cache_aware_below_the_threshold_goes_by_load() -> None:
    policy = Policy(config(cache_threshold=0.5))
    decision = policy.choose(candidates([2.0, 4.0], [3, 1]), None)
    assert (decision.replica.name, decision.reason) == ("r1", "load")
    decision = policy.choose(candidates([4.0, 2.0], [3, 1]), None)
    assert decision.replica.name == "r1"


def test_cache_aware_spreads_new_sessions_over_idle_replicas_by_cache_size() -> None:
    """Below the threshold with equal loads, the replica holding fewer blocks (not the first
    listed): sessions that arrive while every replica idles do not all gather on one."""
    from deepinfer.router.index import PrefixMatch

    policy = Policy(config(cache_threshold=0.5))
    idle = [
        Candidate(FakeReplica("r0"), PrefixMatch(3.0, 3, 3), 10, cached_blocks=40),
        Candidate(FakeReplica("r1"), PrefixMatch(0.0, 0, 0), 10, cached_blocks=0),
    ]
    assert (policy.choose(idle, None).replica.name, policy.choose(idle, None).reason) == ("r1", "load")
    # load still comes first, and a session stays where it was served while loads are equal
    busy = [Candidate(FakeReplica("r0"), None, 10, 40), Candidate(FakeReplica("r1", 1), None, 10, 0)]
    assert policy.choose(busy, None).replica.name == "r0"
    policy.choose([Candidate(FakeReplica("r0"), None, 10, 40)], "s")
    assert policy.choose(idle, "s").replica.name == "r0"


def test_unbalanced_load_overrides_the_cache() -> None:
    policy = Policy(config(balance_abs_threshold=4, balance_rel_threshold=1.5))
    decision = policy.choose(candidates([9.0, 0.0], [10, 1]), None)
    assert (decision.replica.name, decision.reason) == ("r1", "balance")


def test_session_affinity_breaks_ties() -> None:
    policy = Policy(config())
    first = policy.choose(candidates([0.0, 0.0], [0, 0]), "session-1")
    for _ in range(3):
        again = policy.choose(candidates([0.0, 0.0], [0, 0]), "session-1")
        assert again.replica.name == first.replica.name
    other = policy.choose(
        candidates([0.0, 0.0], [1, 0] if first.replica.name == "r0" else [0, 1]), "session-2"
    )
    assert other.replica.name != first.replica.name


def test_round_robin_and_least_load() -> None:
    rr = Policy(config(policy="round_robin"))
    assert [rr.choose(candidates([9.0, 0.0], [0, 9]), None).replica.name for _ in range(4)] == [
        "r0",
        "r1",
    ] * 2
    least = Policy(config(policy="least_load"))
    assert least.choose(candidates([9.0, 0.0], [5, 2]), None).replica.name == "r1"


def test_least_work_weighs_queued_requests_against_the_blocks_a_hit_saves() -> None:
    policy = Policy(config(policy="least_work", request_cost_blocks=4))
    # A new session: the shared system prompt (22 of 28 blocks) is cached on r0 only. Idle, r0 wins
    # (6 blocks to compute against 28); with 6 requests there (6 + 24 > 28), the idle r1 does.
    decision = policy.choose(candidates([22.0, 0.0], [0, 0], total=28), None)
    assert (decision.replica.name, decision.reason) == ("r0", "work")
    assert policy.choose(candidates([22.0, 0.0], [5, 0], total=28), None).replica.name == "r0"
    assert policy.choose(candidates([22.0, 0.0], [6, 0], total=28), None).replica.name == "r1"
    # A session whose 50-block history is cached stays despite a busier replica.
    assert policy.choose(candidates([47.0, 0.0], [8, 0], total=50), None).replica.name == "r0"
    # Equal work (6 + 4 on r0, 10 + 0 on r1): the session's last replica, else the least loaded.
    assert policy.choose(candidates([9.0, 0.0], [0, 0], total=10), "s").replica.name == "r0"
    assert policy.choose(candidates([4.0, 0.0], [1, 0], total=10), "s").replica.name == "r0"
    assert policy.choose(candidates([4.0, 0.0], [1, 0], total=10), None).replica.name == "r1"
    with pytest.raises(ConfigError, match="request_cost_blocks"):
        config(policy="least_work", request_cost_blocks=0)


def test_router_hashes_match_the_engine_hashes() -> None:
    from deepinfer.engine.kv_cache.prefix import extend_block_hashes, namespace_root

    tokens = list(range(50))
    engine_hashes: list[bytes] = []
    extend_block_hashes(engine_hashes, namespace_root("fp", "salt"), tokens, 16)
    features = PromptFeatures(tokens, "salt", None, None)
    assert features.block_hashes("fp", 16, "salt") == engine_hashes[:3]  # (50 - 1) // 16 usable blocks
    assert features.salt_for("key", per_key=True).startswith("key:")


def test_config_errors_name_the_option() -> None:
    with pytest.raises(ConfigError, match=r"^prefill"):
        RouterConfig(prefill=("http://p:1",))
    with pytest.raises(ConfigError, match=r"^replicas"):
        RouterConfig()
    with pytest.raises(ConfigError, match=r"^replicas: expected an http"):
        RouterConfig(replicas=("localhost:8000",))
    with pytest.raises(ConfigError, match=r"^policy"):
        RouterConfig(replicas=("http://a:1",), policy="random")


def test_the_tree_tells_a_shared_system_prompt_from_a_conversations_own_history() -> None:
    from deepinfer.router.branches import ConversationTree

    system = [bytes([1, i]) * 16 for i in range(4)]
    one = [bytes([2, i]) * 16 for i in range(3)]
    two = [bytes([3, i]) * 16 for i in range(3)]
    tree = ConversationTree()
    assert tree.shared_blocks(system + one) == 0  # nothing recorded yet
    tree.record(system + one)
    # a second session leaves the first one's chain after the system prompt
    assert tree.shared_blocks(system + two) == len(system)
    tree.record(system + two)
    # the first session's next turn goes on along its own chain: only the system prompt is shared
    assert tree.shared_blocks(system + one + [b"\x09" * 32]) == len(system)
    # a third session branches where the two others did
    assert tree.shared_blocks([*system, b"\x08" * 32]) == len(system)
    small = ConversationTree(max_nodes=3)
    small.record(system + one)
    assert len(small) == 3  # the oldest links are forgotten


def test_cache_aware_places_a_new_session_sharing_only_the_system_prompt_by_load() -> None:
    """Replica r0 holds the system prompt and session one; a new session's prompt is mostly that
    system prompt. Counting every cached block (SGLang's rule) gathers it on r0; counting only
    the conversation's own blocks places it on the idle, empty r1, while session one's next turn
    stays on r0."""
    from deepinfer.router.branches import ConversationTree

    system = [bytes([1, i]) * 16 for i in range(6)]
    one = [bytes([2, i]) * 16 for i in range(2)]
    two = [bytes([3, i]) * 16 for i in range(2)]
    index = PrefixIndex()
    index.add_replica("r0", None)
    index.add_replica("r1", None)
    index.apply("r0", [stored(system + one)])
    tree = ConversationTree()
    tree.record(system + one)

    def choose(policy: Policy, chain: list[bytes]) -> str:
        shared = tree.shared_blocks(chain)
        candidates = [
            Candidate(FakeReplica("r0"), index.match("r0", chain, shared), len(chain), 8),
            Candidate(FakeReplica("r1"), index.match("r1", chain, shared), len(chain), 0),
        ]
        return policy.choose(candidates, None).replica.name

    assert choose(Policy(config(spread_shared_prefixes=False)), system + two) == "r0"
    assert choose(Policy(config()), system + two) == "r1"
    tree.record(system + two)
    assert choose(Policy(config()), system + one + [b"\x07" * 32]) == "r0"
