"""Issue 29's held-out check on the router's own code, with the prompts' real token ids: two agent
sessions sharing a ~1,900-token system prompt (with a tool), each turn adding a tool call and a
~270-token tool output, 6 turns each sent interleaved. The chat requests are rendered and
tokenized by the router's PromptRenderer (the default model's recipe and tokenizer) and routed
by Router._pick over two replicas: conversation tree, prefix index fed the engines' hashes of
those ids, cache-aware policy. KV events arrive on time, two turns late, never (replicas without
--kv-events-endpoint), or the index is lost before every later turn; each prompt ends as the next
turn repeats it, or with a reply header that the next turn's history writes otherwise.

Before the fix, late events with a retold reply header left 6 of 10 later turns on their own
replica (the previous turn went unrecognised and its blocks counted as shared with another
conversation), and late or absent events put both sessions on one replica.
"""

from __future__ import annotations

import json
import random
from itertools import pairwise

import httpx
import pytest

from deepinfer.bench.router_sessions import WORDS
from deepinfer.config.router import RouterConfig
from deepinfer.router.app import Router
from deepinfer.router.index import PrefixIndex
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.prompt import PromptFeatures, PromptRenderer
from deepinfer.router.replica import ReplicaSet
from deepinfer.transport.kv_events import BlockStored

SYSTEM_WORDS, TASK_WORDS, TOOL_WORDS, TURNS = 1720, 30, 270, 6  # about one token a word
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
# A reply header a recipe may open the reply with and write otherwise once the reply follows
# (15 tokens: it reaches into the last hashed block of some turns' prompts).
REPLY_HEADER = "<think>\nI will call a tool.\n</think>\n\n"
FINGERPRINT, BLOCK = "fp", 16


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    return PromptRenderer.load(None, None)


def _sessions(renderer: PromptRenderer, retold: bool) -> list[list[list[int]]]:
    """Each session's prompts as token ids: the shared system prompt and its own task, then per
    turn the previous messages plus a tool call and its output."""
    system = "You are a coding agent. " + _text(random.Random(0), SYSTEM_WORDS)
    header = renderer.tokenizer.encode(REPLY_HEADER) if retold else []
    sessions = []
    for session in range(2):
        rng = random.Random(session + 1)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task {session}: " + _text(rng, TASK_WORDS)},
        ]
        prompts = []
        for turn in range(TURNS):
            if turn:
                call = {"id": f"call-{session}-{turn}", "type": "function"}
                call["function"] = {"name": "read_file", "arguments": json.dumps({"path": f"src/{turn}.py"})}
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": _text(rng, TOOL_WORDS)}
                )
            body = {"model": "m", "messages": messages, "tools": [TOOL]}
            features = renderer.features("/v1/chat/completions", body, {})
            assert features is not None
            prompts.append(features.token_ids + header)
        sessions.append(prompts)
    return sessions


def _hashes(prompt: list[int]) -> list[bytes]:
    return PromptFeatures(prompt, None, None, None).block_hashes(FINGERPRINT, BLOCK, None)


def _router() -> Router:
    config = RouterConfig(replicas=("http://127.0.0.1:1", "http://127.0.0.1:2"), policy="cache_aware")
    index = PrefixIndex()
    replicas = ReplicaSet(config, index, httpx.AsyncClient())
    for replica in replicas.replicas:
        replica.info = {"fingerprint": FINGERPRINT, "block_size": BLOCK}
        replica.healthy = True
        index.add_replica(replica.name, None)
    return Router(config, replicas, index, None, httpx.AsyncClient(), RouterMetrics())


def _route(sessions: list[list[list[int]]], events: str) -> list[list[str]]:
    """Every turn, the sessions' turns interleaved; the replicas that served each session."""
    router = _router()
    served: list[list[str]] = [[] for _ in sessions]
    pending: list[tuple[str, list[int]]] = []  # computed prompts whose events are on the way
    for turn in range(TURNS):
        for session, prompts in enumerate(sessions):
            if events == "forgotten" and turn:  # a missed health check or an events gap
                router.index.forget(served[session][-1])
            replica = router._pick("both", PromptFeatures(prompts[turn], None, None, None), None, set())
            assert replica is not None
            served[session].append(replica.name)
            pending.append((replica.name, prompts[turn]))
            while pending and (events in ("on_time", "forgotten") or (events == "late" and len(pending) > 2)):
                name, prompt = pending.pop(0)
                router.index.apply(name, [BlockStored(_hashes(prompt), None, [], BLOCK, None, "GPU")])
    return served


@pytest.mark.parametrize("retold", [False, True], ids=["repeated", "retold_header"])
@pytest.mark.parametrize("events", ["on_time", "late", "none", "forgotten"])
def test_held_out_sessions_stay_on_their_own_replica(renderer, events: str, retold: bool) -> None:
    sessions = _sessions(renderer, retold)
    first, second = sessions[0][0], sessions[1][0]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert 1800 <= shared <= 2000  # the system prompt (with the tool) both sessions start with
    growth = [len(b) - len(a) for a, b in pairwise(sessions[0])]
    assert all(270 <= g <= 340 for g in growth)  # a tool call and its ~270-token output
    # the header is retold within the hashed blocks of some turns (never without it)
    extended = [_hashes(b)[: len(_hashes(a))] == _hashes(a) for s in sessions for a, b in pairwise(s)]
    assert not all(extended) if retold else all(extended)

    served = _route(sessions, events)
    own = sum(replica == previous for names in served for previous, replica in pairwise(names))
    assert own >= 8, f"{own} of 10 later turns went to the replica holding the session's history: {served}"
    assert served[0][0] != served[1][0], f"both sessions began on one replica: {served}"


def test_a_previous_turn_with_its_last_block_written_otherwise_is_still_this_conversations() -> None:
    from deepinfer.router.branches import ConversationTree

    system = [bytes([1, i]) * 16 for i in range(4)]
    task = [bytes([2, i]) * 16 for i in range(2)]
    first = [*system, *task, b"h" * 32]  # ends with the reply header
    later = [*system, *task, b"t" * 32, b"u" * 32, b"v" * 32]  # the header written otherwise, then more
    tree = ConversationTree()
    tree.record(first, "r0")
    tree.record([*system, b"o" * 32, b"p" * 32], "r1")  # another session, after the system prompt
    assert tree.previous_turn(later) == (len(first) - 1, "r0")
    assert tree.shared_blocks(later) == len(system)
    # a prompt no longer than the recorded one, leaving it at its last block, is not a later turn
    sibling = [*system, *task, b"s" * 32]
    assert tree.previous_turn(sibling) is None
    assert tree.shared_blocks(sibling) == len(system) + len(task)
