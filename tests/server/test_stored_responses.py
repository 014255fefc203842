"""Stored responses through a real server and the real openai SDK: conversations continued with
`previous_response_id` (every item kind, in order, instructions not carried over), retrieval,
input items, delete, background runs with cancel and stream resume, isolation between API
keys, `store: false`, and conversations that survive a restart (SQLite and Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.server_process import ServerProcess
from tests.store.redis_server import RedisServer

KEY, OTHER_KEY = "sk-responses-a", "sk-responses-b"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {"type": "custom", "name": "apply_patch", "description": "edit files"},
]
PATCH = "*** Begin Patch\n*** End Patch"

pytestmark = pytest.mark.slow


class Served:
    """A server on one response store, restartable on the same store."""

    def __init__(self, *store_args: str) -> None:
        self.args = ("--api-key", KEY, "--api-key", OTHER_KEY, *store_args)
        self.process = ServerProcess(*self.args).start()

    def restart(self) -> None:
        assert self.process.stop() == 0, self.process.log_tail()
        self.process = ServerProcess(*self.args).start()

    def sdk(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.process.url + "/v1", api_key=key, max_retries=0, timeout=120.0)

    def http(self, key: str = KEY) -> httpx.Client:
        return self.process.client(key)

    def stop(self) -> None:
        assert self.process.stop() == 0, self.process.log_tail()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    server = Served("--response-store", f"sqlite:{path}")
    yield server
    server.stop()


@pytest.fixture
def oai(served: Served) -> openai.OpenAI:
    return served.sdk()


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **{"max_output_tokens": 8, **fields})


def dumped(items: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


def tokens(http: httpx.Client, body: dict[str, Any]) -> list[int]:
    answer = http.post("/tokenize", json={"model": MODEL, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_three_turns_with_tool_calls_render_as_the_whole_history(served: Served, oai: openai.OpenAI) -> None:
    first = create(
        oai,
        instructions="Answer like a pirate.",
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=64,
    )
    assert first.store is True
    call = next(item for item in first.output if item.type == "function_call")
    assert call.status == "completed", first.output
    second_input = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Now fix the file."}]},
        {"type": "custom_tool_call", "call_id": "patch_1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "patch_1", "output": "Done!"},
    ]
    second = create(oai, previous_response_id=first.id, input=second_input, tools=TOOLS)
    assert second.previous_response_id == first.id
    third = {
        "instructions": "Be brief.",  # the first turn's instructions are not carried over
        "input": [{"role": "user", "content": "And tomorrow?"}],
        "tools": TOOLS,
    }
    whole = [
        {"role": "user", "content": "What is the weather in Paris?"},
        *dumped(first.output),
        *second_input,
        *dumped(second.output),
        *third["input"],
    ]
    with served.http() as http:
        continued = tokens(http, {**third, "previous_response_id": second.id})
        assert continued == tokens(http, {**third, "input": whole})
        text = http.post("/detokenize", json={"tokens": continued}).json()["prompt"]
    assert "pirate" not in text and "Be brief." in text
    for piece in ("Paris", "18 C and sunny", "Begin Patch", "Done!", "And tomorrow?"):
        assert piece in text
    assert text.index("18 C and sunny") < text.index("Done!") < text.index("And tomorrow?")
    answer = create(oai, previous_response_id=second.id, **third)
    assert answer.usage is not None and answer.usage.input_tokens == len(continued)


def test_retrieve_input_items_delete(oai: openai.OpenAI) -> None:
    made = create(oai, input=[{"role": "user", "content": "Hi"}, {"role": "user", "content": "Bye"}])
    again = oai.responses.retrieve(made.id)
    assert again.id == made.id and again.output_text == made.output_text and again.status == made.status
    items = oai.responses.input_items.list(made.id, order="asc")
    assert [item.content[0].text for item in items.data] == ["Hi", "Bye"]  # type: ignore[union-attr]
    newest = oai.responses.input_items.list(made.id, limit=1)
    assert newest.data[0].content[0].text == "Bye" and newest.has_more  # type: ignore[union-attr]
    oai.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        create(oai, previous_response_id=made.id, input="more")
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_streamed_response_is_stored_when_it_ends(oai: openai.OpenAI) -> None:
    events = list(create(oai, input="Say hello.", stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status in ("completed", "incomplete") and final.output_text
    assert oai.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_keeps_nothing(oai: openai.OpenAI) -> None:
    made = create(oai, input="Hello", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        create(oai, input="Hello", store=False, background=True)
    assert refused.value.body["param"] == "background"  # type: ignore[index]


def test_another_key_sees_nothing(served: Served, oai: openai.OpenAI) -> None:
    made = create(oai, input="A secret")
    other = served.sdk(OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(made.id)
    with pytest.raises(openai.BadRequestError):
        create(other, previous_response_id=made.id, input="continue")
    assert oai.responses.retrieve(made.id).id == made.id


def test_background_runs_without_the_client_and_resumes_its_stream(oai: openai.OpenAI) -> None:
    queued = create(oai, input="Say hi.", background=True, max_output_tokens=16)
    assert queued.status == "queued" and queued.background
    events = list(oai.responses.retrieve(queued.id, stream=True))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.queued"
    assert events[-1].type in ("response.completed", "response.incomplete")
    done = oai.responses.retrieve(queued.id)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert done.status == events[-1].response.status and done.output_text == streamed  # type: ignore[union-attr]
    resumed = list(oai.responses.retrieve(queued.id, stream=True, starting_after=4))
    assert [event.sequence_number for event in resumed] == numbers[5:]
    assert oai.responses.cancel(queued.id).status == done.status  # ended: left as it is


def test_cancel_stops_a_background_run(oai: openai.OpenAI) -> None:
    queued = create(oai, input="Tell a very long story about a cat.", background=True, max_output_tokens=400)
    follow = oai.responses.retrieve(queued.id, stream=True)
    for event in follow:
        if event.type == "response.output_text.delta":
            break
    cancelled = oai.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    rest = list(follow)
    assert rest and rest[-1].response.status == "cancelled"  # type: ignore[union-attr]
    final = oai.responses.retrieve(queued.id)
    assert final.status == "cancelled"
    plain = create(oai, input="Hi")
    with pytest.raises(openai.BadRequestError):
        oai.responses.cancel(plain.id)


@pytest.mark.parametrize(
    ("query", "param"),
    [({"stream": "maybe"}, "stream"), ({"stream": "true", "starting_after": "x"}, "starting_after")],
)
def test_bad_queries_name_the_field(
    served: Served, oai: openai.OpenAI, query: dict[str, str], param: str
) -> None:
    made = create(oai, input="Hi", background=True)
    with served.http() as http:
        answer = http.get(f"/v1/responses/{made.id}", params=query)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_a_restart_keeps_the_conversation(served: Served) -> None:
    _conversation_across_a_restart(served)


def _conversation_across_a_restart(served: Served) -> None:
    before = create(served.sdk(), input="My name is Ada. Say OK.")
    served.restart()
    oai = served.sdk()
    assert oai.responses.retrieve(before.id).output_text == before.output_text
    after = create(oai, previous_response_id=before.id, input="What is my name?")
    with served.http() as http:
        text = http.post(
            "/detokenize",
            json={"tokens": tokens(http, {"previous_response_id": after.id, "input": "Thanks."})},
        ).json()["prompt"]
    assert "My name is Ada" in text and "What is my name?" in text


def test_a_restart_keeps_the_conversation_on_redis(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    try:
        served = Served("--response-store", redis.url)
        try:
            _conversation_across_a_restart(served)
        finally:
            served.stop()
    finally:
        redis.stop()
