"""`python -m deepinfer.bench.router_sessions`: do agent sessions stay on the replica holding their history?

Two replicas of the default model behind `deepinfer router --policy cache_aware`; sessions that
share one long system prompt (~1,900 tokens, with a tool definition), each turn adding an
assistant tool call and a ~270-token tool output, their turns sent interleaved (one session's
turn, then the next session's; `--together` sends every session's turn at once). For every turn
after the first, it reports whether the router sent it to the replica that served the session's
previous turn (which holds its history) and to a replica that had served some turn (which holds
the system prompt). Issue 29's check: 2 sessions x 6 turns, 10 later turns.
"""

from __future__ import annotations

import argparse
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from deepinfer.bench.cluster import replica, router, running
from deepinfer.router.app import REPLICA_HEADER

WORDS = [
    "file",
    "read",
    "write",
    "patch",
    "test",
    "build",
    "error",
    "line",
    "value",
    "code",
    "module",
    "branch",
    "commit",
    "diff",
    "review",
    "function",
    "class",
    "return",
    "import",
    "config",
    "server",
    "client",
    "request",
    "answer",
    "cache",
    "block",
    "token",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def session_turns(
    session: int, turns: int, system_words: int, tool_words: int, seed: int
) -> list[list[dict]]:
    """The message lists of one session's turns: each is the previous one plus a tool call and
    its output. The system prompt depends on `seed` only: every session shares it."""
    system = "You are a coding agent. " + _text(random.Random(seed), system_words)
    rng = random.Random(seed * 1000 + session + 1)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Task {session}: " + _text(rng, 30)},
    ]
    result = [list(messages)]
    for turn in range(1, turns):
        call = {"id": f"call-{session}-{turn}", "type": "function"}
        call["function"] = {"name": "read_file", "arguments": json.dumps({"path": f"src/{turn}.py"})}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng, tool_words)})
        result.append(list(messages))
    return result


def _send(url: str, model: str, messages: list[dict], max_tokens: int) -> str:
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    return reply.headers[REPLICA_HEADER]


def run_sessions(
    url: str, sessions: list[list[list[dict]]], max_tokens: int, together: bool
) -> dict[str, int]:
    """Send the turns interleaved; count later turns on their session's previous replica and on
    a replica that served something before (it holds the shared system prompt)."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    served: list[list[str]] = [[] for _ in sessions]
    seen: set[str] = set()
    own = system = later = 0
    for turn in range(len(sessions[0])):
        if together:
            with ThreadPoolExecutor(len(sessions)) as pool:
                names = list(
                    pool.map(
                        _send,
                        [url] * len(sessions),
                        [model] * len(sessions),
                        [s[turn] for s in sessions],
                        [max_tokens] * len(sessions),
                    )
                )
        else:
            names = [_send(url, model, s[turn], max_tokens) for s in sessions]
        for index, name in enumerate(names):
            if turn > 0:
                later += 1
                own += name == served[index][-1]
                system += name in seen
            served[index].append(name)
        seen.update(names)
    return {"later_turns": later, "on_own_replica": own, "on_system_prompt_replica": system}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.bench.router_sessions", description=__doc__)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=1500, help="~1,900 tokens")
    parser.add_argument("--tool-words", type=int, default=215, help="~270 tokens a tool output")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--together", action="store_true", help="send every session's turn at once")
    parser.add_argument("--router-arg", action="append", default=[], help="extra `deepinfer router` flag")
    args = parser.parse_args(argv)
    sessions = [
        session_turns(s, args.turns, args.system_words, args.tool_words, seed=0) for s in range(args.sessions)
    ]
    replicas = [replica(f"replica-{i}") for i in range(2)]
    with running(replicas):
        urls = [a for r in replicas for a in ("--replica", r.url)]
        with running([router("router", *urls, "--policy", "cache_aware", *args.router_arg)]) as (front,):
            counts = run_sessions(front.url, sessions, args.max_tokens, args.together)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
