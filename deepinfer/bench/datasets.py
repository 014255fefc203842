"""Benchmark datasets generated locally from a seed (nothing is downloaded).

Lengths are counted in words drawn from a list of short, common English words; with a BPE
tokenizer such a word (with its leading space) is about one token, so a requested length in
"tokens" is close to what the server counts. The exact counts come back in the server's usage.

- ``random``: independent single-turn prompts of set lengths (like ``vllm bench serve
  --dataset-name random``), optionally varied by ``range_ratio``.
- ``agent``: multi-turn sessions. Every turn resends one long system prompt (policy text plus
  tool descriptions, identical across all sessions) and the session's growing history, then a
  new user message; the first may carry a context of the session's own (``context_len`` words:
  the files an agent attaches to its task). Turns of a session go out one after another, each
  when the previous one has finished: the traffic where prefix caching pays. The assistant turns in the history are
  synthetic (not the server's replies) so every engine sees exactly the same prompts.
- ``sharegpt-like``: a synthetic conversational mix. Prompt and reply lengths are lognormal
  with means matched to the ShareGPT statistics reported in the vLLM paper (Kwon et al., 2023:
  161 prompt and 338 output tokens on average). The spreads (σ=1.0 for prompts, σ=0.8 for
  replies) are chosen to give ShareGPT's heavy right tail, not fitted (the data is not here);
  lengths are clipped to [4, 8 × mean]. 40% of requests carry 1–3 earlier turns of history.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

DATASET_NAMES: tuple[str, ...] = ("random", "agent", "sharegpt-like")

SHAREGPT_MEAN_INPUT = 161
SHAREGPT_MEAN_OUTPUT = 338
SHAREGPT_SIGMA_INPUT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.8
SHAREGPT_HISTORY_FRACTION = 0.4

_VOCABULARY: tuple[str, ...] = tuple(
    [
        "time",
        "year",
        "people",
        "way",
        "day",
        "man",
        "thing",
        "woman",
        "life",
        "child",
        "world",
        "school",
        "state",
        "family",
        "student",
        "group",
        "country",
        "problem",
        "hand",
        "part",
        "place",
        "case",
        "week",
        "company",
        "system",
        "program",
        "question",
        "work",
        "government",
        "number",
        "night",
        "point",
        "home",
        "water",
        "room",
        "mother",
        "area",
        "money",
        "story",
        "fact",
        "month",
        "lot",
        "right",
        "study",
        "book",
        "eye",
        "job",
        "word",
        "business",
        "issue",
        "side",
        "kind",
        "head",
        "house",
        "service",
        "friend",
        "father",
        "power",
        "hour",
        "game",
        "line",
        "end",
        "member",
        "law",
        "car",
        "city",
        "name",
        "team",
        "minute",
        "idea",
        "kid",
        "body",
        "back",
        "parent",
        "face",
        "others",
        "level",
        "office",
        "door",
        "health",
        "person",
        "art",
        "war",
        "history",
        "party",
        "result",
        "change",
        "morning",
        "reason",
        "research",
        "girl",
        "guy",
        "moment",
        "air",
        "teacher",
        "force",
        "order",
        "model",
        "data",
        "table",
        "file",
        "list",
        "value",
        "method",
        "class",
        "test",
        "code",
        "build",
        "run",
        "find",
        "make",
        "take",
        "give",
        "tell",
        "ask",
        "need",
        "feel",
        "try",
        "leave",
        "call",
        "keep",
        "let",
        "begin",
        "seem",
        "help",
        "show",
        "hear",
        "play",
        "move",
        "live",
        "believe",
        "bring",
        "happen",
        "write",
        "sit",
        "stand",
        "lose",
        "pay",
        "meet",
        "include",
        "continue",
        "set",
        "learn",
        "lead",
        "understand",
        "watch",
        "follow",
        "stop",
        "create",
        "speak",
        "read",
        "spend",
        "grow",
        "open",
        "walk",
        "win",
        "offer",
        "remember",
        "love",
        "consider",
        "appear",
        "buy",
        "wait",
        "serve",
        "die",
        "send",
        "expect",
        "stay",
        "fall",
        "cut",
        "reach",
        "kill",
        "remain",
        "good",
        "new",
        "first",
        "last",
        "long",
        "great",
        "little",
        "own",
        "other",
        "old",
        "big",
        "high",
        "different",
        "small",
        "large",
        "next",
        "early",
        "young",
        "important",
        "few",
        "public",
        "bad",
        "same",
        "able",
        "late",
        "hard",
        "major",
        "better",
        "best",
        "sure",
        "free",
        "true",
    ]
)

_TOOL_NAMES: tuple[str, ...] = (
    "search_files",
    "read_file",
    "write_file",
    "run_tests",
    "list_directory",
    "grep_code",
    "fetch_issue",
    "create_branch",
)


@dataclass(slots=True)
class BenchRequest:
    """One request to send; ``session_id``'s requests are sent in ``turn`` order."""

    request_id: str
    session_id: int
    turn: int
    system: str | None
    messages: list[dict[str, str]]
    output_len: int
    approx_input_tokens: int

    def as_text_prompt(self) -> str:
        """The conversation as one plain prompt for the completions API."""
        parts = [self.system] if self.system else []
        for message in self.messages:
            parts.append(f"{message['role'].capitalize()}: {message['content']}")
        parts.append("Assistant:")
        return "\n\n".join(parts)


@dataclass(slots=True)
class Dataset:
    name: str
    sessions: list[list[BenchRequest]] = field(default_factory=list)

    @property
    def requests(self) -> list[BenchRequest]:
        return [request for session in self.sessions for request in session]

    def __len__(self) -> int:
        return sum(len(session) for session in self.sessions)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(max(count, 0)))


def _sentences(rng: random.Random, count: int) -> str:
    """Roughly ``count`` words punctuated like prose, so chat templates see ordinary text."""
    sentences: list[str] = []
    remaining = max(count, 1)
    while remaining > 0:
        length = min(rng.randint(6, 16), remaining)
        words = [rng.choice(_VOCABULARY) for _ in range(length)]
        sentences.append(" ".join(words).capitalize() + rng.choice((".", ".", ".", "?")))
        remaining -= length
    return " ".join(sentences)


def _approx_tokens(system: str | None, messages: list[dict[str, str]]) -> int:
    text = " ".join([system or ""] + [m["content"] for m in messages])
    return len(text.split())


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, seed: int, range_ratio: float = 0.0
) -> Dataset:
    """Independent prompts; lengths uniform in [len·(1−r), len·(1+r)] for range_ratio r."""
    _check_positive("num_prompts", num_prompts)
    _check_positive("input_len", input_len)
    _check_positive("output_len", output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be within [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def vary(length: int) -> int:
        low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    sessions = []
    for index in range(num_prompts):
        prompt = _words(rng, vary(input_len))
        messages = [{"role": "user", "content": prompt}]
        sessions.append(
            [
                BenchRequest(
                    request_id=f"random-{index}",
                    session_id=index,
                    turn=0,
                    system=None,
                    messages=messages,
                    output_len=vary(output_len),
                    approx_input_tokens=_approx_tokens(None, messages),
                )
            ]
        )
    return Dataset("random", sessions)


def _agent_system_prompt(rng: random.Random, length: int) -> str:
    """A policy paragraph followed by tool descriptions, about ``length`` words in all."""
    tools = []
    for name in _TOOL_NAMES:
        params = ", ".join(f'"{rng.choice(_VOCABULARY)}_{i}": "string"' for i in range(3))
        tools.append(f"- {name}({{{params}}}): {_sentences(rng, 12)}")
    tool_text = "You can call these tools:\n" + "\n".join(tools)
    policy_len = max(length - len(tool_text.split()), 16)
    return "You are a coding agent. " + _sentences(rng, policy_len) + "\n\n" + tool_text


def agent_dataset(
    num_prompts: int,
    system_len: int,
    output_len: int,
    seed: int,
    turns_per_session: int = 4,
    user_len: int = 64,
    context_len: int = 0,
) -> Dataset:
    """Sessions of ``turns_per_session`` turns sharing one system prompt; ``num_prompts`` turns in
    all; each session's first user message is ``context_len`` words longer (its own context)."""
    _check_positive("num_prompts", num_prompts)
    _check_positive("input_len (the shared system prompt)", system_len)
    _check_positive("output_len", output_len)
    _check_positive("agent_turns", turns_per_session)
    _check_positive("agent_user_len", user_len)
    if context_len < 0:
        raise ValueError(f"agent_context_len must be >= 0, got {context_len}")
    rng = random.Random(seed)
    system = _agent_system_prompt(rng, system_len)
    sessions: list[list[BenchRequest]] = []
    remaining = num_prompts
    session_id = 0
    while remaining > 0:
        history: list[dict[str, str]] = []
        session: list[BenchRequest] = []
        for turn in range(min(turns_per_session, remaining)):
            words = user_len + (context_len if turn == 0 else 0)
            history.append({"role": "user", "content": _sentences(rng, words)})
            messages = list(history)
            session.append(
                BenchRequest(
                    request_id=f"agent-{session_id}-{turn}",
                    session_id=session_id,
                    turn=turn,
                    system=system,
                    messages=messages,
                    output_len=output_len,
                    approx_input_tokens=_approx_tokens(system, messages),
                )
            )
            history.append({"role": "assistant", "content": _sentences(rng, output_len)})
        sessions.append(session)
        remaining -= len(session)
        session_id += 1
    return Dataset("agent", sessions)


def _lognormal_length(rng: random.Random, mean: int, sigma: float) -> int:
    # A lognormal's mean is exp(mu + sigma²/2); pick mu so the mean is the requested one.
    mu = math.log(mean) - sigma * sigma / 2
    return int(min(max(round(rng.lognormvariate(mu, sigma)), 4), 8 * mean))


def sharegpt_like_dataset(
    num_prompts: int,
    seed: int,
    mean_input_len: int = SHAREGPT_MEAN_INPUT,
    mean_output_len: int = SHAREGPT_MEAN_OUTPUT,
) -> Dataset:
    _check_positive("num_prompts", num_prompts)
    _check_positive("input_len", mean_input_len)
    _check_positive("output_len", mean_output_len)
    rng = random.Random(seed)
    sessions = []
    for index in range(num_prompts):
        total_input = _lognormal_length(rng, mean_input_len, SHAREGPT_SIGMA_INPUT)
        earlier_turns = rng.randint(1, 3) if rng.random() < SHAREGPT_HISTORY_FRACTION else 0
        # The history takes up to half of the prompt; the last user message gets the rest.
        history_budget = total_input // 2 if earlier_turns else 0
        messages: list[dict[str, str]] = []
        for _ in range(earlier_turns):
            share = max(history_budget // (2 * earlier_turns), 2)
            messages.append({"role": "user", "content": _sentences(rng, share)})
            messages.append({"role": "assistant", "content": _sentences(rng, share)})
        messages.append({"role": "user", "content": _sentences(rng, total_input - history_budget)})
        sessions.append(
            [
                BenchRequest(
                    request_id=f"sharegpt-like-{index}",
                    session_id=index,
                    turn=0,
                    system=None,
                    messages=messages,
                    output_len=_lognormal_length(rng, mean_output_len, SHAREGPT_SIGMA_OUTPUT),
                    approx_input_tokens=_approx_tokens(None, messages),
                )
            ]
        )
    return Dataset("sharegpt-like", sessions)


def build_dataset(
    name: str,
    num_prompts: int,
    seed: int,
    input_len: int | None = None,
    output_len: int | None = None,
    range_ratio: float = 0.0,
    agent_turns: int = 4,
    agent_user_len: int = 64,
    agent_context_len: int = 0,
) -> Dataset:
    """The named dataset; lengths left None take that dataset's defaults."""
    if name == "random":
        return random_dataset(num_prompts, input_len or 1024, output_len or 128, seed, range_ratio)
    if name == "agent":
        return agent_dataset(
            num_prompts,
            input_len or 1024,
            output_len or 128,
            seed,
            agent_turns,
            agent_user_len,
            agent_context_len,
        )
    if name == "sharegpt-like":
        return sharegpt_like_dataset(
            num_prompts, seed, input_len or SHAREGPT_MEAN_INPUT, output_len or SHAREGPT_MEAN_OUTPUT
        )
    raise ValueError(f"dataset must be one of {', '.join(DATASET_NAMES)}, got {name!r}")
