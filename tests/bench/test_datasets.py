from __future__ import annotations

import itertools
import statistics

import pytest

from deepinfer.bench.datasets import (
    SHAREGPT_MEAN_INPUT,
    SHAREGPT_MEAN_OUTPUT,
    agent_dataset,
    build_dataset,
    random_dataset,
    sharegpt_like_dataset,
)


def _words(request) -> int:
    return len(" ".join(m["content"] for m in request.messages).split())


def test_random_dataset_is_seeded_with_exact_lengths() -> None:
    first = random_dataset(8, input_len=50, output_len=7, seed=3)
    again = random_dataset(8, input_len=50, output_len=7, seed=3)
    other = random_dataset(8, input_len=50, output_len=7, seed=4)
    assert [r.messages for r in first.requests] == [r.messages for r in again.requests]
    assert [r.messages for r in first.requests] != [r.messages for r in other.requests]
    assert len(first) == 8
    assert all(_words(r) == 50 and r.output_len == 7 and r.system is None for r in first.requests)
    assert len({r.messages[0]["content"] for r in first.requests}) == 8


def test_random_dataset_range_ratio_bounds_lengths() -> None:
    dataset = random_dataset(200, input_len=100, output_len=20, seed=0, range_ratio=0.5)
    lengths = [_words(r) for r in dataset.requests]
    assert 50 <= min(lengths) < 70 and 130 < max(lengths) <= 150
    assert all(10 <= r.output_len <= 30 for r in dataset.requests)


def test_agent_sessions_share_the_system_prompt_and_grow_their_history() -> None:
    dataset = agent_dataset(10, system_len=300, output_len=12, seed=1, turns_per_session=4, user_len=20)
    assert len(dataset) == 10
    assert [len(s) for s in dataset.sessions] == [4, 4, 2]
    systems = {r.system for r in dataset.requests}
    assert len(systems) == 1
    system = systems.pop()
    assert "search_files(" in system and 250 <= len(system.split()) <= 350
    for session in dataset.sessions:
        assert [r.turn for r in session] == list(range(len(session)))
        for earlier, later in itertools.pairwise(session):
            # The next turn resends everything before it, plus a reply and a new question.
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert [m["role"] for m in later.messages[len(earlier.messages) :]] == ["assistant", "user"]
            assert len(later.messages[len(earlier.messages)]["content"].split()) == 12
    first_turns = [s[0].messages[0]["content"] for s in dataset.sessions]
    assert len(set(first_turns)) == len(first_turns)


def test_an_agent_session_can_open_with_its_own_context() -> None:
    dataset = agent_dataset(
        4, system_len=200, output_len=8, seed=2, turns_per_session=2, user_len=10, context_len=300
    )
    for session in dataset.sessions:
        first, second = session
        assert len(first.messages[0]["content"].split()) == 310  # the context and the question
        assert len(second.messages[-1]["content"].split()) == 10  # later turns: the question only
    with pytest.raises(ValueError, match="agent_context_len"):
        agent_dataset(2, system_len=200, output_len=8, seed=0, context_len=-1)


def test_sharegpt_like_lengths_follow_the_documented_means() -> None:
    dataset = sharegpt_like_dataset(3000, seed=0)
    inputs = [r.approx_input_tokens for r in dataset.requests]
    outputs = [r.output_len for r in dataset.requests]
    # Clipping at 8× the mean trims the tail a little, so allow 10%.
    assert statistics.mean(inputs) == pytest.approx(SHAREGPT_MEAN_INPUT, rel=0.1)
    assert statistics.mean(outputs) == pytest.approx(SHAREGPT_MEAN_OUTPUT, rel=0.1)
    assert min(inputs) >= 4 and max(inputs) <= 8 * SHAREGPT_MEAN_INPUT
    # Heavy right tail: the median sits well below the mean.
    assert statistics.median(inputs) < 0.8 * statistics.mean(inputs)
    with_history = sum(1 for r in dataset.requests if len(r.messages) > 1)
    assert 0.35 < with_history / len(dataset) < 0.45
    assert all(r.messages[-1]["role"] == "user" for r in dataset.requests)


def test_build_dataset_validates_names_and_lengths() -> None:
    with pytest.raises(ValueError, match="dataset must be one of"):
        build_dataset("sharegpt", 4, 0)
    with pytest.raises(ValueError, match="num_prompts"):
        build_dataset("random", 0, 0)
    with pytest.raises(ValueError, match="input_len"):
        build_dataset("agent", 4, 0, input_len=-3)
    assert build_dataset("random", 2, 0, 10, 5).requests[0].output_len == 5


def test_text_prompt_for_completions_keeps_every_turn() -> None:
    request = agent_dataset(2, system_len=40, output_len=5, seed=0, turns_per_session=2).sessions[0][1]
    text = request.as_text_prompt()
    assert text.startswith(request.system)
    assert text.endswith("Assistant:")
    assert text.count("User: ") == 2 and text.count("Assistant: ") == 1
