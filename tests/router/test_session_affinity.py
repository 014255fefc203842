"""Agent sessions that share a long system prompt stay on the replica holding their own history
(issue 29's check): two sessions over a ~1,900-token system prompt, each turn adding a ~270-token
tool output, their turns sent interleaved through the router's own choosing code (candidates,
conversation tree, prefix index, cache-aware policy), with the replicas' KV events arriving late,
on time, or lost. Before the router remembered where it sent each prompt, events arriving after
the session's next turn left 5 of 10 later turns on their own replica (the held-out check found 4)."""

from __future__ import annotations

import random

import httpx
import pytest

from deepinfer.config.router import RouterConfig
from deepinfer.router.app import Router
from deepinfer.router.index import PrefixIndex
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.prompt import PromptFeatures
from deepinfer.router.replica import ReplicaSet
from deepinfer.transport.kv_events import BlockStored

URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2")
BLOCK = 16
SYSTEM, TASK, TOOL_OUTPUT, ANSWER, TURNS = 1900, 30, 270, 20, 6


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(count)]


def _sessions(count: int) -> list[list[list[int]]]:
    """Each session's prompts: the shared system prompt, its task, then per turn the previous
    prompt plus an answer (a tool call) and a tool output."""
    system = _tokens(random.Random(0), SYSTEM)
    sessions = []
    for session in range(count):
        rng = random.Random(session + 1)
        prompt = system + _tokens(rng, TASK)
        turns = [prompt]
        for _ in range(TURNS - 1):
            prompt = prompt + _tokens(rng, ANSWER + TOOL_OUTPUT)
            turns.append(prompt)
        sessions.append(turns)
    return sessions


def _router() -> Router:
    config = RouterConfig(replicas=URLS, policy="cache_aware")
    index = PrefixIndex()
    replicas = ReplicaSet(config, index, httpx.AsyncClient())
    for replica in replicas.replicas:
        replica.info = {"fingerprint": "fp", "block_size": BLOCK}
        replica.healthy = True
        index.add_replica(replica.name, None)
    return Router(config, replicas, index, None, httpx.AsyncClient(), RouterMetrics())


def _computed(router: Router, replica: str, prompt: list[int]) -> None:
    """The replica's KV events for a prompt it computed reach the router."""
    hashes = PromptFeatures(prompt, None, None, None).block_hashes("fp", BLOCK, None)
    router.index.apply(replica, [BlockStored(hashes, None, [], BLOCK, None, "GPU")])


def _run(events: str, sessions: int = 2) -> tuple[int, int, int]:
    """Route every turn, sessions interleaved; count the later turns sent where the session's
    previous turn went, and those sent where the system prompt had been computed."""
    router = _router()
    served: list[list[str]] = [[] for _ in range(sessions)]
    late: list[tuple[str, list[int]]] = []
    own = with_system = later = 0
    for turn in range(TURNS):
        for session, prompts in enumerate(_sessions(sessions)):
            prompt = prompts[turn]
            if events == "forgotten" and turn:  # the index of the session's replica was lost (a
                router.index.forget(served[session][-1])  # missed health check, an events gap)
            replica = router._pick("both", PromptFeatures(prompt, None, None, None), None, set())
            assert replica is not None
            if turn:
                later += 1
                own += replica.name == served[session][-1]
                with_system += any(replica.name in names for names in served)
            served[session].append(replica.name)
            if events == "late":  # a prompt's events arrive after the next two are routed
                late.append((replica.name, prompt))
                if len(late) > 2:
                    _computed(router, *late.pop(0))
            else:
                _computed(router, replica.name, prompt)
    return own, with_system, later


@pytest.mark.parametrize("events", ["on_time", "late", "forgotten"])
def test_interleaved_sessions_stay_on_their_own_replica(events: str) -> None:
    own, with_system, later = _run(events)
    assert later == 10
    assert own == 10, f"only {own} of 10 later turns went where the session's history is"
    assert with_system == 10


def test_new_sessions_still_spread_over_the_replicas() -> None:
    """The two first turns share only the system prompt: they go to different replicas, and a
    third session's first turn goes by load, not to the replica of the session before it."""
    router = _router()
    sessions = _sessions(3)
    first = []
    for session in sessions[:2]:
        replica = router._pick("both", PromptFeatures(session[0], None, None, None), None, set())
        assert replica is not None
        _computed(router, replica.name, session[0])
        first.append(replica)
    assert first[0].name != first[1].name
    first[1].inflight = 1  # busy with the second session's turn
    third = router._pick("both", PromptFeatures(sessions[2][0], None, None, None), None, set())
    assert third is not None and third.name == first[0].name


def test_the_tree_remembers_where_each_prompt_went() -> None:
    from deepinfer.router.branches import ConversationTree

    chain = [bytes([i]) * 32 for i in range(6)]
    tree = ConversationTree(max_nodes=4)
    assert tree.previous_turn(chain) is None
    tree.record(chain[:3], "r0")
    tree.record(chain[:5], "r1", pool="prefill")
    assert tree.previous_turn(chain) == (3, "r0")
    assert tree.previous_turn(chain, "prefill") == (5, "r1")
    assert tree.previous_turn(chain[:2]) is None  # only a longer prompt went anywhere
    for i in range(4):  # the oldest prompt ends are forgotten past max_nodes
        tree.record([bytes([9, i]) * 16], "r1")
    assert tree.previous_turn(chain) is None
