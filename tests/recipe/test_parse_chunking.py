"""Chunking invariance: any split of a recorded output parses to the one-shot result."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.recipe.events import ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from deepinfer.recipe.parse import CompletionBuilder, StreamParser
from tests.recipe.conftest import counting_ids
from tests.recipe.samples import SAMPLES, Sample


def run(sample: Sample, chunks: list[str]):
    parser = StreamParser(sample.spec, id_factory=counting_ids())
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish(sample.finish))  # type: ignore[arg-type]
    builder = CompletionBuilder()
    builder.extend(events)
    return builder.result(), events


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_one_shot_parse_gives_the_expected_message(sample):
    """The one-shot parse of each recording is the message it stands for."""
    result, _ = run(sample, [sample.text])
    assert result.reasoning == sample.reasoning
    assert result.content == sample.content
    assert [(c.name, c.arguments) for c in result.tool_calls] == list(sample.calls)
    assert result.finish_reason == sample.finish_reason
    assert [c.id for c in result.tool_calls] == [f"call_{i}" for i in range(len(sample.calls))]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_character_by_character_equals_one_shot(sample):
    """Feeding one character at a time (every marker split at every point) changes nothing."""
    assert run(sample, list(sample.text))[0] == run(sample, [sample.text])[0]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_split_equals_one_shot(sample, data):
    """Any split of the stream gives the one-shot result, and each call's argument deltas
    concatenate to exactly its final arguments."""
    cuts = data.draw(st.lists(st.integers(min_value=1, max_value=max(1, len(sample.text) - 1)), max_size=40))
    result, events = run(sample, split(sample.text, cuts))
    assert result == run(sample, [sample.text])[0]
    deltas: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index not in deltas
            deltas[event.index] = []
        elif isinstance(event, ToolCallArgsDelta):
            deltas[event.index].append(event.delta)
        elif isinstance(event, ToolCallEnd):
            assert "".join(deltas[event.index]) == event.arguments
