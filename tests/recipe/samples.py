"""Recorded model outputs in every supported format, with the message each must parse into.

The texts follow what the models emit (DeepSeek-V3.2 DSML, V3.1 and R1 special tokens, Qwen's
Hermes blocks, Llama-3.1 JSON), including reasoning, several calls, parameterless tools,
unicode and emoji, and the awkward bits: a tool-end marker inside a JSON string, arguments sent
as a JSON string, malformed blocks and outputs cut off by the token limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.recipe.parse.stream import ParserSpec

DS_EOS = "<｜end▁of▁sentence｜>"
TOOLS = ("get_weather", "get_time", "search")


@dataclass(frozen=True)
class Sample:
    name: str
    spec: ParserSpec
    text: str
    reasoning: str
    content: str
    calls: tuple[tuple[str, str], ...]  # (name, arguments)
    finish: str = "stop"  # what the engine reports
    finish_reason: str = "tool_calls"  # what the parser reports


def _spec(family: str, fmt: str | None, initial: str, stop: tuple[str, ...]) -> ParserSpec:
    return ParserSpec(family=family, tool_format=fmt, initial=initial, stop_markers=stop, tool_names=TOOLS)


V32 = _spec("deepseek_v32", "dsml", "reasoning", (DS_EOS,))
V4 = _spec("deepseek_v4", "dsml_v4", "reasoning", (DS_EOS,))
V41 = _spec("deepseek_v41", "dsml_v41", "reasoning", (DS_EOS,))
V31 = _spec("deepseek_v31", "deepseek_v31", "content", (DS_EOS,))
V31_THINK = _spec("deepseek_v31", "deepseek_v31", "reasoning", (DS_EOS,))
R1 = _spec("deepseek_r1", "deepseek_r1", "reasoning", (DS_EOS,))
QWEN3 = _spec("chat_template", "hermes", "maybe_reasoning", ("<|im_end|>",))
SMOL = _spec("chat_template", "hermes", "content", ("<|im_end|>",))
LLAMA = _spec("chat_template", "llama3_json", "content", ("<|eot_id|>", "<|eom_id|>"))

D = "｜DSML｜"

SAMPLES = [
    Sample(
        "dsml-v41",
        V41,
        "Weather first.</think>Checking.\n\n"
        f'<{D} calls>\n<{D} invoke name="get_weather">\n'
        f'<{D} parameter name="location" string="true">Zürich</{D} parameter>\n'
        f'<{D} parameter name="days" string="false">2</{D} parameter>\n'
        f'</{D} invoke>\n<{D} invoke name="get_time">\n\n</{D} invoke>\n</{D} calls>{DS_EOS}',
        "Weather first.",
        "Checking.",
        (("get_weather", '{"location": "Zürich", "days": 2}'), ("get_time", "{}")),
    ),
    Sample(
        "dsml-v4-without-block-wrapper",
        V4,
        "\n\nHmm.\n\n</think>\n\nOn it: "
        f'<{D}invoke name="get_time">\n<{D}parameter name="tz" string="true">UTC</{D}parameter>\n'
        f"</{D}invoke>{DS_EOS}",
        "Hmm.",
        "On it: ",
        (("get_time", '{"tz": "UTC"}'),),
    ),
    Sample(
        "dsml-v41-malformed-never-reaches-content",
        V41,
        f'</think>Sure.\n\n<{D} calls>\n<{D} invoke name="get_time">\n<{D} parameter name="n" string="false">'
        f"{{bad json</{D} parameter>\n</{D} invoke>\n</{D} calls>after{DS_EOS}",
        "",
        "Sure.",
        (),
        finish_reason="stop",
    ),
    Sample(
        "dsml",
        V32,
        "The user wants weather 🌦️ for São Paulo. I'll call get_weather, then get_time.\n</think>\n\n"
        "Let me look that up — un momento.\n\n"
        f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="location" string="true">São Paulo "SP"\n(line 2)</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
        f'<{D}parameter name="opts" string="false">{{"units": ["°C", null]}}</{D}parameter>\n'
        f'</{D}invoke>\n<{D}invoke name="get_time">\n\n</{D}invoke>\n</{D}function_calls>{DS_EOS}',
        "The user wants weather 🌦️ for São Paulo. I'll call get_weather, then get_time.",
        "Let me look that up — un momento.",
        (
            (
                "get_weather",
                '{"location": "São Paulo \\"SP\\"\\n(line 2)", "days": 3, "opts": {"units": ["°C", null]}}',
            ),
            ("get_time", "{}"),
        ),
    ),
    Sample(
        "dsml-text-only",
        V32,
        f"Short think.</think>Plain answer: 2 < 3 and <b>bold</b> </think> stays.{DS_EOS}ignored",
        "Short think.",
        "Plain answer: 2 < 3 and <b>bold</b> </think> stays.",
        (),
        finish_reason="stop",
    ),
    Sample(
        "deepseek-v31",
        V31,
        "Sure 😀<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"location": "Zürich", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
        f"<｜tool▁call▁end｜><｜tool▁calls▁end｜>{DS_EOS}",
        "",
        "Sure 😀",
        (("get_weather", '{"location": "Zürich", "days": 2}'), ("get_time", "{}")),
    ),
    Sample(
        "deepseek-v31-thinking",
        V31_THINK,
        "Need the time first.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
        '{"tz": "Asia/Tōkyō"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Need the time first.",
        "Checking.",
        (("get_time", '{"tz": "Asia/Tōkyō"}'),),
    ),
    Sample(
        "deepseek-r1",
        R1,
        "Okay, the user asks about 東京.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"location": "東京"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
        f"<｜tool▁calls▁end｜>{DS_EOS}",
        "Okay, the user asks about 東京.",
        "",
        (("get_weather", '{"location": "東京"}'), ("get_time", "{}")),
    ),
    Sample(
        "hermes-qwen3",
        QWEN3,
        "<think>\nThe user wants two things.\n</think>\n\nI'll check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "Kraków", "note": "a } brace and </tool_call> inside"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>',
        "The user wants two things.",
        "I'll check both.",
        (
            ("get_weather", '{"location": "Kraków", "note": "a } brace and </tool_call> inside"}'),
            ("get_time", "{}"),
        ),
    ),
    Sample(
        "hermes-no-think",
        QWEN3,
        "Just text with a <tag> and <think> later.<|im_end|>",
        "",
        "Just text with a <tag> and <think> later.",
        (),
        finish_reason="stop",
    ),
    Sample(
        "hermes-string-arguments",
        SMOL,
        '<tool_call>\n{"arguments": "{\\"q\\": \\"emoji 🎉\\"}", "name": "search"}\n</tool_call>',
        "",
        "",
        (("search", '{"q": "emoji 🎉"}'),),
    ),
    Sample(
        "llama3-json",
        LLAMA,
        '{"name": "get_weather", "parameters": {"location": "Paris", "days": 1}}; '
        '{"name": "get_time", "parameters": {}}<|eot_id|>',
        "",
        "",
        (("get_weather", '{"location": "Paris", "days": 1}'), ("get_time", "{}")),
    ),
    Sample(
        "llama3-json-answer-is-text",
        LLAMA,
        '{"answer": 42, "name": "get_weather"}',
        "",
        '{"answer": 42, "name": "get_weather"}',
        (),
        finish_reason="stop",
    ),
    Sample(
        "hermes-malformed",
        SMOL,
        'Text\n<tool_call>\n{"name": "get_time", "arguments": {"a": }}\n</tool_call>\nmore',
        "",
        'Text\n<tool_call>\n{"name": "get_time", "arguments": {"a": }}\n</tool_call>\nmore',
        (),
        finish_reason="stop",
    ),
    Sample(
        "dsml-cut-by-length",
        V32,
        f'Plan.</think>\n\n<{D}function_calls>\n<{D}invoke name="get_time">\n</{D}invoke>\n'
        f'<{D}invoke name="get_weather">\n<{D}parameter name="location" string="true">Par',
        "Plan.",
        "",  # the cut call is neither a call nor answer text
        (("get_time", "{}"),),
        finish="length",
        finish_reason="length",
    ),
]
