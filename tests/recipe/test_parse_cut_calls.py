"""A tool call cut by the end of the output never reaches the answer text, in every tool format.

Each output (a short answer, then two calls) is cut at every character from the start of its
tool markup to its end, parsed in one piece (a non-streamed response) and character by
character (a stream), and finished with `length` (max_tokens) or `stop` (EOS or a stop string
at that point). The text is the answer before the markup, never a piece of it; the calls are
those whose markup was whole, in order; the finish reason stays `length`.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from deepinfer.recipe.parse import CompletionBuilder, StreamParser
from deepinfer.recipe.parse.result import ParsedCompletion
from deepinfer.recipe.parse.stream import ParserSpec
from tests.recipe.conftest import counting_ids
from tests.recipe.samples import LLAMA, R1, SMOL, V4, V31, V32, V41

ANSWER = "Let me check."
CALLS = (("get_weather", {"city": "Paris", "days": 2}), ("get_time", {}))
D = "｜DSML｜"


def _hermes() -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS
    )


def _llama() -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)


def _v31() -> str:
    calls = "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in CALLS
    )
    return f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"


def _r1() -> str:
    calls = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
        for n, a in CALLS
    )
    return f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"


def _dsml(block: str, gap: str) -> str:
    def param(key: str, value: object) -> str:
        is_str = isinstance(value, str)
        shown = value if is_str else json.dumps(value)
        return f'<{D}{gap}parameter name="{key}" string="{str(is_str).lower()}">{shown}</{D}{gap}parameter>\n'

    invokes = "".join(
        f'<{D}{gap}invoke name="{n}">\n' + "".join(param(k, v) for k, v in a.items()) + f"</{D}{gap}invoke>\n"
        for n, a in CALLS
    )
    return f"<{D}{gap}{block}>\n{invokes}</{D}{gap}{block}>"


# (spec, text before the answer, separator before the markup, the markup, what ends its first call)
FORMATS: dict[str, tuple[ParserSpec, str, str, str, str]] = {
    "hermes": (SMOL, "", "\n", _hermes(), "</tool_call>"),
    "llama3_json-python-tag": (LLAMA, "", " ", "<|python_tag|>" + _llama(), "}}"),
    "deepseek_v31": (V31, "", "", _v31(), "<｜tool▁call▁end｜>"),
    "deepseek_r1": (R1, "Hm.</think>", "", _r1(), "<｜tool▁call▁end｜>"),
    "dsml-v32": (V32, "Hm.</think>", "\n\n", _dsml("function_calls", ""), f"</{D}invoke>"),
    "dsml-v4": (V4, "Hm.</think>", "\n\n", _dsml("tool_calls", ""), f"</{D}invoke>"),
    "dsml-v41": (V41, "Hm.</think>", "\n\n", _dsml("calls", " "), f"</{D} invoke>"),
}


def _run(spec: ParserSpec, pieces: list[str], reason: str) -> ParsedCompletion:
    parser = StreamParser(spec, id_factory=counting_ids())
    builder = CompletionBuilder()
    for piece in pieces:
        builder.extend(parser.feed(piece))
    builder.extend(parser.finish(reason))  # type: ignore[arg-type]
    return builder.result()


@pytest.mark.parametrize("reason", ["length", "stop"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_cut_call_never_reaches_the_text(name: str, reason: str) -> None:
    spec, head, gap, markup, first_end = FORMATS[name]
    output = head + ANSWER + gap + markup
    start = len(head + ANSWER)
    first_call_end = output.index(first_end) + len(first_end)
    calls_so_far = 0
    for cut in range(start, len(output)):
        whole = _run(spec, [output[:cut]], reason)
        streamed = _run(spec, list(output[:cut]), reason)
        assert (streamed.content, streamed.tool_calls, streamed.finish_reason) == (
            whole.content,
            [replace(c, id=w.id) for c, w in zip(streamed.tool_calls, whole.tool_calls, strict=True)],
            whole.finish_reason,
        ), (name, cut)
        assert whole.content.strip() == ANSWER, (name, reason, cut, whole.content)
        names = [c.name for c in whole.tool_calls]
        assert names == [n for n, _ in CALLS][: len(names)], (name, cut, names)
        for call, (_, arguments) in zip(whole.tool_calls, CALLS, strict=False):
            assert json.loads(call.arguments) == arguments
        # Calls never disappear as the cut moves on; the first stands once its markup closed.
        assert len(names) >= calls_so_far, (name, cut)
        calls_so_far = len(names)
        if cut >= first_call_end:
            assert names, (name, cut)
        assert whole.finish_reason == ("length" if reason == "length" else "tool_calls" if names else "stop")
    result = _run(spec, [output], "stop")
    assert [c.name for c in result.tool_calls] == [n for n, _ in CALLS]
    assert result.content.strip() == ANSWER and result.finish_reason == "tool_calls"


@pytest.mark.parametrize("reason", ["length", "stop"])
def test_bare_llama_json_cut_is_a_call_only_once_it_names_a_tool(reason: str) -> None:
    """Llama-3.1's calls open the reply with a bare `{`: cut where it still is (or may become) a
    call, it is dropped; a JSON answer that can no longer be a call stays text."""
    calls = _llama()
    for cut in range(1, len(calls)):
        result = _run(LLAMA, [calls[:cut]], reason)
        assert result.content == "", (cut, result.content)
    answer = '{"answer": 42, "note": "x"}'
    for cut in range(1, len(answer)):
        text = _run(LLAMA, [answer[:cut]], reason).content
        assert text == ("" if cut <= 2 else answer[:cut]), (cut, text)
